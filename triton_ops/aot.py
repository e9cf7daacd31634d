"""Ahead-of-time compile report of the Triton kernels, no GPU needed: every launch specialization of
:mod:`triton_ops.aot_cases` compiled for sm_80 / sm_90 with ``triton.compile`` (TTIR -> TTGIR -> PTX -> cubin, the
wheel's ``ptxas``), with per specialization the registers, stack, spill stores / loads, shared memory and the PTX
global load widths inside loops (are code loads vectorised?).

Where the numbers come from: registers, stack and static shared memory from the wheel's ``cuobjdump
--dump-resource-usage`` on the cubin; spill stores / loads from ``ptxas -v`` (the log of the ptxas run Triton's
compile makes, ``TRITON_DUMP_PTXAS_LOG``; ``TRITON_ALWAYS_COMPILE`` so that a cached kernel still shows it); shared
memory as launched from the kernel's metadata (``shared``, Triton's dynamic allocation).

    python -m triton_ops.aot --out eval/results/triton_aot                 the report (markdown + json)
    python -m triton_ops.aot --preset ci --targets 90 --json -             the CI set (model-shaped, sm_90)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REG_LIMIT = 128  # registers per thread a model-shaped split_attn_kernel may use (4 warps: 4 programs per SM)


def tool(name: str) -> str | None:
    """Path of a tool shipped in the triton wheel (``cuobjdump``, ``ptxas``), or None."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.access(path, os.X_OK) else None


_PTXAS = re.compile(
    r"Used (?P<regs>\d+) registers.*?(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, "
    r"(?P<ld>\d+) bytes spill loads",
    re.S,
)
_PTXAS_SPILLS = re.compile(r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, (?P<ld>\d+) bytes spill")
_CUOBJ = re.compile(r"REG:(?P<regs>\d+) STACK:(?P<stack>\d+) SHARED:(?P<shared>\d+) LOCAL:(?P<local>\d+)")


def loop_load_widths(ptx: str) -> str:
    """Global loads inside loops of a PTX listing, counted by width, e.g. ``"v4.b32:4 b8:2"`` (a loop: the lines
    from a label to a later branch back to it)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^\s*(\$L__\w+):", ln))}
    in_loop = [False] * len(lines)
    for i, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", ln)
        if m and labels.get(m.group(1), len(lines)) < i:
            for j in range(labels[m.group(1)], i):
                in_loop[j] = True
    counts: dict[str, int] = {}
    for ln, inside in zip(lines, in_loop):
        m = re.search(r"\bld\.global(?:\.\w+)*?\.((?:v\d\.)?[busf]\d+)\b", ln)
        if inside and m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return (
        " ".join(
            f"{k}:{v}"
            for k, v in sorted(counts.items(), key=lambda kv: (-int(kv[0][1]) if kv[0][0] == "v" else 0, kv[0]))
        )
        or "-"
    )


def compile_launch(launch, capability: int) -> dict:
    """Compile one :class:`~triton_ops.launch.Launch` for ``sm_<capability>``: its resource usage, or ``error``."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    fn, signature, constexprs, attrs, options = launch.compile_inputs(target)
    log = io.StringIO()
    row: dict = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    t0 = time.perf_counter()
    try:
        with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            knobs.compilation.always_compile = True
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options)
    except Exception as e:  # a compile error is a result of the report
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    row["shared"] = int(kernel.metadata.shared)
    m = _PTXAS_SPILLS.search(log.getvalue())
    if m:
        row.update(ptxas_stack=int(m["stack"]), spill_stores=int(m["st"]), spill_loads=int(m["ld"]))
    row.update(_cuobjdump(kernel.asm["cubin"]))
    row["loop_loads"] = loop_load_widths(kernel.asm["ptx"])
    return row


def _cuobjdump(cubin: bytes) -> dict:
    exe = tool("cuobjdump")
    if exe is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([exe, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    m = _CUOBJ.search(out)
    return {"regs": int(m["regs"]), "stack": int(m["stack"]), "static_shared": int(m["shared"])} if m else {}


def jobs(preset: str) -> list[tuple[str, str, str, bool, object]]:
    """``(kernel, case name, setting, model_shaped, Launch)`` of a preset: ``ci`` (:func:`aot_cases.ci_cases`'
    split attention), ``models`` (every model-shaped case, both kernels) or ``all`` (those, the sweep and the
    quantize kernels). One row per distinct merge specialization."""
    from .aot_cases import ci_cases, model_cases, quantize_launches, sweep_cases

    cases = {"ci": ci_cases, "models": model_cases}.get(preset, lambda: model_cases() + sweep_cases())()
    out, merges = [], set()
    for c in cases:
        for kernel, launch in c.launches().items():
            if kernel == "merge_kernel":
                key = (repr(sorted(launch.constexprs.items())), _arg_kinds(launch))
                if preset == "ci" or key in merges:
                    continue
                merges.add(key)
            out.append((kernel, c.name, c.setting(), c.model_shaped, launch))
    if preset == "all":
        out += [(k, "prefill", tag, False, launch) for k, tag, launch in quantize_launches()]
    return out


def _arg_kinds(launch) -> str:
    return ",".join(str(a.dtype) if hasattr(a, "dtype") else str(a == 1) for a in launch.args)


def run(preset: str, targets: list[int], progress: bool = True) -> list[dict]:
    from tqdm import tqdm

    work = [(cap, job) for job in jobs(preset) for cap in targets]
    rows = []
    for cap, (kernel, name, setting, model, launch) in tqdm(work, desc=f"AOT {preset}", disable=not progress):
        row = {"kernel": kernel, "case": name, "setting": setting, "model_shaped": model, "target": f"sm_{cap}"}
        row.update(compile_launch(launch, cap))
        row["constexprs"] = {k: str(v) for k, v in launch.constexprs.items()}
        rows.append(row)
    return rows


def problems(rows: list[dict]) -> list[str]:
    """What the report must not show: a compile error, a spill, a model-shaped split attention over
    :data:`REG_LIMIT` registers."""
    out = []
    for r in rows:
        where = f"{r['kernel']} {r['case']} [{r['setting']}] {r['target']}"
        if "error" in r:
            out.append(f"{where}: does not compile: {r['error']}")
        elif r.get("spill_stores", 0) or r.get("spill_loads", 0):
            out.append(f"{where}: spills {r['spill_stores']} B stores / {r['spill_loads']} B loads")
        elif r["kernel"] == "split_attn_kernel" and r["model_shaped"] and r.get("regs", 0) > REG_LIMIT:
            out.append(f"{where}: {r['regs']} registers > {REG_LIMIT}")
    return out


def summary(rows: list[dict]) -> list[str]:
    """Per kernel and target: compiles, errors, spilling specializations, registers (most; most of the
    model-shaped ones), shared memory (most)."""
    head = "| kernel | target | compiles | errors | spilling | max regs | max regs, model-shaped | max shared (B) |"
    out = [head, "|---|---|---|---|---|---|---|---|"]
    for kernel, target in dict.fromkeys((r["kernel"], r["target"]) for r in rows):
        rs = [r for r in rows if (r["kernel"], r["target"]) == (kernel, target)]
        ok = [r for r in rs if "error" not in r]
        spill = sum(1 for r in ok if r.get("spill_stores", 0) or r.get("spill_loads", 0))
        model = [r["regs"] for r in ok if r["model_shaped"] and "regs" in r]
        cells = [kernel, target, len(rs), len(rs) - len(ok), spill, max((r.get("regs", 0) for r in ok), default="")]
        cells += [max(model) if model else "-", max((r.get("shared", 0) for r in ok), default="")]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return out


def markdown(rows: list[dict], command: str) -> str:
    cols = ("kernel", "case", "setting", "target", "regs", "stack", "spill_stores", "spill_loads", "shared")
    head = ["| " + " | ".join(cols + ("warps/stages", "loop loads")) + " |", "|" + "---|" * (len(cols) + 2)]
    body = []
    for r in rows:
        cells = [str(r.get(c, "")) for c in cols]
        if "error" in r:
            cells[4:] = ["**" + r["error"].replace("|", "/") + "**"] + [""] * (len(cols) - 5)
        body.append("| " + " | ".join(cells + [f"{r['num_warps']}/{r['num_stages']}", r.get("loop_loads", "")]) + " |")
    bad = problems(rows)
    text = [
        "# Triton kernels compiled ahead of time (no GPU)",
        "",
        f"Command: `{command}`",
        "",
        f"{len(rows)} compiles; {len(bad)} problems (a compile error, a spill, a model-shaped split attention over "
        f"{REG_LIMIT} registers per thread). Registers and stack: `cuobjdump --dump-resource-usage` on the cubin; "
        "spills: `ptxas -v`; shared: the bytes Triton allocates at launch; loop loads: global loads inside PTX loops "
        "by width (v4.b32 = 16 bytes per thread and instruction). No GPU ran these kernels: this is what they compile "
        "to.",
        "",
        *[f"- {p}" for p in bad],
        "",
        "## Summary",
        "",
        *summary(rows),
        "",
        "## Every specialization",
        "",
    ]
    return "\n".join(text + head + body) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("ci", "models", "all"), default="all")
    ap.add_argument("--targets", default="80,90", help="compute capabilities, comma-separated (default 80,90)")
    ap.add_argument("--out", help="folder for report.md and report.json")
    ap.add_argument("--json", help="also write the rows as json here ('-': stdout)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        ap.error("unset TRITON_INTERPRET: the report compiles the kernels, the interpreter does not")
    missing = [t for t in ("ptxas", "cuobjdump") if tool(t) is None]
    if missing:
        print(f"the triton wheel has no {' / '.join(missing)} (triton/backends/nvidia/bin): cannot compile for a GPU")
        return 2
    command = "python -m triton_ops.aot " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = run(args.preset, [int(t) for t in args.targets.split(",")], not args.no_progress)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write(markdown(rows, command))
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump({"command": command, "rows": rows}, f, indent=1)
    if args.json:
        text = json.dumps({"command": command, "rows": rows})
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    bad = problems(rows)
    for p in bad:
        print(p, file=sys.stderr)
    print(f"{len(rows)} compiles, {len(bad)} problems", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
