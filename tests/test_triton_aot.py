"""The Triton kernels compiled ahead of time for a GPU on this CPU machine (``python -m triton_ops.aot``): the
model-shaped split attention (Llama-3-8B, Qwen2.5-7B, SmolLM2, Gemma 3, a D128 MHA; 0, 1 and 2 packed segments;
8-bit formats; L_q 4; sinks; soft-capping) must compile for sm_90 with no spill and at most 128 registers per
thread. The compiles run in a subprocess: this test session interprets the kernels (``TRITON_INTERPRET=1`` in
``test_triton_kernels``), the report needs them compiled. About 1.5 minutes on 2 cores.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tools_or_skip():
    pytest.importorskip("triton", reason="the AOT compile needs the triton package (pip install triton)")
    from triton_ops.aot import tool

    missing = [t for t in ("ptxas", "cuobjdump") if tool(t) is None]
    if missing:
        pytest.skip(f"the installed triton wheel ships no {' / '.join(missing)} (triton/backends/nvidia/bin)")


def test_model_shaped_split_attention_compiles_for_sm90_without_spills(tmp_path):
    _tools_or_skip()
    out = tmp_path / "ci.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    cmd = [sys.executable, "-m", "triton_ops.aot", "--preset", "ci", "--targets", "90", "--json", str(out)]
    proc = subprocess.run(cmd + ["--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), f"the AOT report did not run (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    rows = json.loads(out.read_text())["rows"]
    from triton_ops.aot import REG_LIMIT, problems

    assert len(rows) >= 30 and {r["case"] for r in rows} >= {"llama3-8b", "qwen2.5-7b", "gemma3-270m", "mha-d128"}
    assert {r["constexprs"]["SEGS"] for r in rows} == {"0", "1", "2"}
    assert {r["constexprs"]["G_A"] for r in rows if r["kernel"] == "split_attn_kernel"} >= {"32", "64"}  # recommended()
    for r in rows:  # every compile was read, so that a parse failure cannot pass for "no spill"
        assert "error" in r or {"regs", "spill_stores", "spill_loads", "shared"} <= r.keys(), r
    assert problems(rows) == [], "\n".join(problems(rows))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert max(r["regs"] for r in rows) <= REG_LIMIT


def test_report_flags_errors_spills_and_registers():
    """The report's judge on made-up rows: each kind of problem is named, a clean row is not."""
    pytest.importorskip("triton", reason="triton_ops needs the triton package")
    from triton_ops.aot import loop_load_widths, problems

    base = dict(kernel="split_attn_kernel", case="m", setting="s", target="sm_90", model_shaped=True)
    clean = dict(base, regs=128, spill_stores=0, spill_loads=0)
    rows = [clean, dict(base, error="CompilationError: x"), dict(clean, spill_stores=8), dict(clean, regs=130)]
    rows.append(dict(clean, regs=200, model_shaped=False))  # the register limit is for model-shaped cases
    found = problems(rows)
    assert len(found) == 3
    assert "does not compile" in found[0] and "spills 8 B" in found[1] and "130 registers > 128" in found[2]
    ptx = "\n".join(
        [
            "ld.global.b32 {%r1}, [%rd1];",  # before the loop: not counted
            "$L__BB0_2:  // loop",
            "@%p1 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd2 + 0 ];",
            "ld.global.b8 { %rs1 }, [ %rd3 + 0 ];",
            "@%p2 bra \t$L__BB0_2;",
        ]
    )
    assert loop_load_widths(ptx) == "v4.b32:1 b8:1"
