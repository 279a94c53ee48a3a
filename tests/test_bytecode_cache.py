"""The bytecode cache (xdp.cache): the switch loaded from it is the program BCC compiled and
loads itself (the kernel's tag of each program, which leaves map references out, is the same),
its maps pinned and found again, and a pin of another layout refused with one line."""
import os
import shutil
import uuid

import pytest

from switchd.dataplane import DataPlane, Deployment, SwitchError
import xdp
from xdp import cache, libbpf, loader

pytestmark = pytest.mark.bpf


def program_tags(dp: DataPlane) -> dict[str, bytes]:
    return {n: libbpf.prog_tag(p.fd) for n, p in (("ingress", dp.ingress), ("egress", dp.egress),
                                                  ("write", dp.writer))}


@pytest.fixture
def pin_dir():
    path = f"/sys/fs/bpf/kvswitch-test-cache-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def bcc_tags(dep: Deployment) -> dict[str, bytes]:
    """The tags of the switch's programs as BCC itself compiles and loads them."""
    import bcc
    bpf = loader._compile((xdp.source("kvswitch.c"), xdp.source("kvwrite.c")), dep.cflags())
    try:
        return {n: libbpf.prog_tag(bpf.load_func(f.encode(), bcc.BPF.XDP, None, attach).fd)
                for n, f, attach in (("ingress", "kv_ingress", -1),
                                     ("egress", "kv_egress", bcc.BPFAttachType.XDP_DEVMAP),
                                     ("write", "kv_write", -1))}
    finally:
        bpf.cleanup()


def test_the_switch_from_the_cache_is_the_program_bcc_compiled(fresh_cache, pin_dir):
    dep = Deployment(chunk_size=1024, cache_entries=512, pin_dir=pin_dir)
    compiled = DataPlane(dep)                   # compiled, its entry written, loaded from it
    assert len(list(fresh_cache.glob("*.json"))) == 1
    compiled.set("port_checks", 1)
    tags = program_tags(compiled)
    assert tags == bcc_tags(dep)
    ids = {n: compiled.map_id(n) for n in ("kv_cache", "kv_stats", "kv_settings")}
    compiled.bpf.cleanup()

    loaded = DataPlane(dep)                     # same pins: the maps are found again
    try:
        assert isinstance(loaded.bpf, cache.CachedObject)
        assert program_tags(loaded) == tags
        assert {n: loaded.map_id(n) for n in ids} == ids
        assert loaded.get("port_checks") == 1
        assert len(loaded.cache) == 512
        assert set(loaded.counters()) == set(loaded.STAT_NAMES.values())
    finally:
        loaded.bpf.cleanup()
    # maps the source does not pin are the loader's own: a fresh copy each load
    assert "kv_devmap" not in os.listdir(pin_dir) and "kv_cache" in os.listdir(pin_dir)


def test_a_pin_of_another_layout_is_refused_with_one_line(pin_dir):
    first = f"{pin_dir}-first"                  # the pinned deployment's entry is in the cache
    DataPlane(Deployment(chunk_size=1024, cache_entries=512, pin_dir=first)).bpf.cleanup()
    shutil.rmtree(first)
    os.makedirs(pin_dir)
    fd = libbpf.map_create("kv_settings", libbpf.BPF_MAP_TYPE_ARRAY, 4, 4, 3)
    libbpf.obj_pin(fd, f"{pin_dir}/kv_settings")
    os.close(fd)
    with pytest.raises(SwitchError) as err:
        DataPlane(Deployment(chunk_size=1024, cache_entries=512, pin_dir=pin_dir))
    assert "\n" not in str(err.value) and f"{pin_dir}/kv_settings" in str(err.value)
    assert "remove the pin" in str(err.value)
