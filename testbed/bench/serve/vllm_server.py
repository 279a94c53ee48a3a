"""`vllm serve` in a testbed node and vLLM's own benchmark client (`vllm bench serve`) against
it, both run as a user runs them: the `vllm` command of the venv (`make setup` makes it work on
the CPU wheel: ``hostagent.inference.vllm_dist``), in the node's namespace, the server with the
kvswitch connector through ``--kv-transfer-config`` (or without it), the client on the same node
(127.0.0.1) saving vLLM's own result JSON, per-request texts included (``--save-detailed``).

Each server's engine runs on one CPU of its own (``VLLM_CPU_OMP_THREADS_BIND``), so servers on
one box do not share a core's OpenMP threads.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...lab import TestbedError, Topology
from ...lab.lab import await_log_line

PORT = 8000
READY = "Application startup complete"
ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
# vLLM's own counters a run reports (summed over their labels)
METRICS = ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
           "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits",
           "vllm:prompt_tokens", "vllm:request_success")
CONNECTOR = {"kv_connector": "KVSwitchConnector",
             "kv_connector_module_path": "hostagent.inference.connectors.vllm",
             "kv_role": "kv_both"}


def vllm_command() -> str:
    """The venv's `vllm` command, or TestbedError with the line that installs it."""
    exe = Path(sys.executable).with_name("vllm")
    if not exe.exists():
        raise TestbedError(f"no {exe}: run 'make setup' (pip install -e '.[vllm]' and "
                           "python -m hostagent.inference.vllm_dist)")
    return str(exe)


@dataclass(frozen=True)
class ServerSpec:
    """What every server of a run shares: the model, its KV space and scheduling, and the
    connector's ``kv_connector_extra_config`` (None: vLLM alone)."""
    model_dir: str
    served_name: str
    max_model_len: int
    kv_blocks: int                      # vLLM blocks of KV space (--num-gpu-blocks-override)
    block_size: int = 128               # tokens per vLLM block (the CPU backend's default)
    max_batched_tokens: int = 512       # per step: longer prompts are prefilled in chunks
    max_num_seqs: int = 8
    dtype: str = "float32"              # the fast dtype on this AVX2 CPU
    connector: dict | None = None
    extra_args: tuple[str, ...] = field(default=())

    def argv(self) -> list[str]:
        argv = [vllm_command(), "serve", self.model_dir, "--host", "127.0.0.1",
                "--port", str(PORT), "--served-model-name", self.served_name,
                "--dtype", self.dtype, "--enforce-eager", "--seed", "0",
                "--max-model-len", str(self.max_model_len),
                "--block-size", str(self.block_size),
                "--num-gpu-blocks-override", str(self.kv_blocks),
                "--enable-prefix-caching", "--enable-chunked-prefill",
                "--max-num-batched-tokens", str(self.max_batched_tokens),
                "--max-num-seqs", str(self.max_num_seqs), *self.extra_args]
        if self.connector is not None:
            argv += ["--kv-transfer-config",
                     json.dumps({**CONNECTOR, "kv_connector_extra_config": self.connector})]
        return argv


class VllmServer:
    """One `vllm serve` in ``node``, its output in ``log_path``, its engine on CPU ``core``."""

    def __init__(self, topo: Topology, node: str, spec: ServerSpec, log_path: str, core: int):
        self.topo, self.node, self.spec, self.log_path = topo, node, spec, log_path
        self.core, self.proc, self._offset = core, None, 0

    def start(self) -> None:
        env = {**os.environ, **ENV, "VLLM_CPU_OMP_THREADS_BIND": str(self.core)}
        with open(self.log_path, "ab") as log:
            self._offset = log.tell()           # a log of an earlier run is not this one's
            self.proc = self.topo.popen(self.node, self.spec.argv(), stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        await_log_line(self.proc, self.log_path, self._offset, READY, timeout,
                       f"vllm serve on {self.node}")

    def metrics(self) -> dict[str, float]:
        """vLLM's own counters (``METRICS``) from the server's /metrics endpoint."""
        fetch = ("import urllib.request; print(urllib.request.urlopen("
                 f"'http://127.0.0.1:{PORT}/metrics', timeout=10).read().decode())")
        text = self.topo.run(self.node, [sys.executable, "-c", fetch], timeout=60).stdout
        out = dict.fromkeys(METRICS, 0.0)
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            name = name.split("{", 1)[0].removesuffix("_total")
            if name in out:
                out[name] += float(value.split()[0])
        return out

    def log(self, since: int | None = None) -> str:
        """What this run of the server printed (from offset ``since`` of its log)."""
        with open(self.log_path, errors="replace") as f:
            f.seek(self._offset if since is None else since)
            return f.read()

    def log_size(self) -> int:
        return os.path.getsize(self.log_path)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM (vLLM shuts its engine down), then SIGKILL to the whole session."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@dataclass(frozen=True)
class Workload:
    """vLLM's ``prefix_repetition`` dataset: ``prefixes`` prefixes of ``prefix_len`` random
    tokens, each prompt one of them plus a ``suffix_len`` suffix of its own, ``prompts`` in all
    (as many per prefix, shuffled), Poisson arrivals at ``rate`` per second; the same ``seed``
    gives every client the same prompts in the same order at the same offsets."""
    prefix_len: int = 512
    suffix_len: int = 32
    prefixes: int = 8
    output_len: int = 8
    prompts: int = 32
    rate: float = 0.25
    seed: int = 1

    def argv(self, spec: ServerSpec, result_dir: str, result_name: str) -> list[str]:
        return [vllm_command(), "bench", "serve", "--backend", "vllm",
                "--base-url", f"http://127.0.0.1:{PORT}", "--model", spec.served_name,
                "--tokenizer", spec.model_dir, "--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(self.prefix_len),
                "--prefix-repetition-suffix-len", str(self.suffix_len),
                "--prefix-repetition-num-prefixes", str(self.prefixes),
                "--prefix-repetition-output-len", str(self.output_len),
                "--num-prompts", str(self.prompts), "--request-rate", str(self.rate),
                "--seed", str(self.seed), "--temperature", "0", "--ignore-eos",
                "--save-result", "--save-detailed", "--result-dir", result_dir,
                "--result-filename", result_name, "--disable-tqdm",
                "--ready-check-timeout-sec", "0"]


def run_clients(topo: Topology, nodes: list[str], workload: Workload, spec: ServerSpec,
                result_dir: str, tag: str, timeout: float,
                delays: list[float] | None = None) -> list[dict]:
    """One `vllm bench serve` per node, all started at once (node i's ``delays[i]`` seconds
    later); vLLM's result JSON of each."""
    procs, names = [], []
    env = {**os.environ, **ENV}
    for i, node in enumerate(nodes):
        name = f"{tag}-{node}.json"
        log = open(os.path.join(result_dir, f"{tag}-{node}.client.log"), "wb")
        argv = workload.argv(spec, result_dir, name)
        if delays and delays[i]:
            argv = ["sh", "-c", f"sleep {delays[i]:g}; exec " + shlex.join(argv)]
        procs.append((node, log, topo.popen(node, argv,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)))
        names.append(name)
    deadline, results = time.monotonic() + timeout, []
    try:
        for (node, log, p), name in zip(procs, names):
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TestbedError(f"vllm bench serve on {node} still running after "
                                   f"{timeout:g} s") from None
            path = Path(result_dir) / name
            if p.returncode or not path.exists():
                raise TestbedError(f"vllm bench serve on {node} exited {p.returncode}: "
                                   f"{Path(log.name).read_text(errors='replace')[-800:]}")
            results.append(json.loads(path.read_text()))
    finally:
        for _, log, p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            log.close()
    return results
