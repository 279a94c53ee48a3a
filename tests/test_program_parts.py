"""A program split into parts (xdp/loader.py): a local C file a program includes is pasted in
place of the line, so BCC rewrites the part's map calls as its main file's; ``#line`` markers
keep each line's own file and number; the bytecode cache's key covers the parts; the switch is
built this way (kvswitch.c and its three parts; tests/test_source_size.py keeps each file under
500 lines)."""
import pytest

import xdp
from xdp import NoXdp, libbpf
from xdp.loader import load_xdp, program_text

MAIN = """#include <linux/bpf.h>
BPF_ARRAY(hits, __u64, 1);
#include "part.c"
int counted(struct xdp_md *ctx)
{
    return bump() ? XDP_DROP : XDP_PASS;
}
"""
PART = """/* a part: a helper with a map call */
static __always_inline int bump(void)
{
    __u32 k = 0;
    __u64 *v = hits.lookup(&k);
    if (v)
        *v += 1;
    return 0;
}
"""


@pytest.fixture
def program(tmp_path, fresh_cache):
    (tmp_path / "main.c").write_text(MAIN)
    (tmp_path / "part.c").write_text(PART)
    return tmp_path


def test_a_part_is_pasted_in_place_with_line_markers(program):
    text = program_text(program / "main.c").splitlines()
    at = text.index('#line 1 "part.c"')
    assert text[:at] == ['#line 1 "main.c"', *MAIN.splitlines()[:2]]
    assert text[at + 1:at + 1 + len(PART.splitlines())] == PART.splitlines()
    # after the part, the main file goes on at its own next line: 4
    assert text[at + 1 + len(PART.splitlines())] == '#line 4 "main.c"'
    assert text[-4:] == MAIN.splitlines()[-4:]
    assert "#include \"part.c\"" not in text and '#include <linux/bpf.h>' in text


def test_a_header_include_is_left_to_the_compiler(program):
    (program / "main.c").write_text('#include "kvproto.h"\n')
    assert program_text(program / "main.c") == '#line 1 "main.c"\n#include "kvproto.h"\n'


@pytest.mark.bpf
def test_a_part_s_map_calls_work_and_its_errors_name_it(program, capfd):
    bpf, fns = load_xdp(program / "main.c", ("counted",))
    for _ in range(3):
        verdict, _ = libbpf.xdp_test_run(fns["counted"].fd, bytes(64))
        assert verdict == 2                                          # XDP_PASS
    hits = bpf.get_table(b"hits")
    assert hits[hits.Key(0)].value == 3
    # editing a part is a new program: the cache's key covers it
    (program / "part.c").write_text(PART.replace("*v += 1;", "*v += 1;\n    *v += ;"))
    with pytest.raises(NoXdp, match="compiling main.c failed"):
        load_xdp(program / "main.c", ("counted",))
    assert "part.c:8:" in capfd.readouterr().err


def test_the_switch_is_its_file_and_its_three_parts():
    text = program_text(xdp.source("kvswitch.c"))
    parts = ["kvswitch_cache.c", "kvswitch_rounds.c", "kvswitch_ports.c"]
    assert [f for f in parts if f'#line 1 "{f}"' in text] == parts
    assert "int kv_ingress(struct xdp_md *ctx)" in text and '#include "kvswitch_' not in text
