"""eval/gpu_check.sh: the dry run (imports vs the GPU machine's package list and the shipped wheels, pip calls), and
the two GPU benchmarks' code paths on CPU (--smoke)."""

import os
import subprocess
import sys
import zipfile

import pytest

from eval import gpu_check_dry_run as dry
from eval.paths import GPU_PACKAGES, REPO_ROOT

needs_package_list = pytest.mark.skipif(not os.path.isfile(GPU_PACKAGES), reason=f"{GPU_PACKAGES} not found")


def _fake_wheel(folder, dist, version, requires=()):
    """A minimal wheel: just its METADATA (what the dry run reads)."""
    name = dist.replace("-", "_")
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(
            f"{name}-{version}.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
                dist, version, "".join(f"Requires-Dist: {r}\n" for r in requires)
            ),
        )


def _dry_run(wheels):
    return subprocess.run(
        ["bash", "eval/gpu_check.sh", "--dry-run"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, GPU_WHEELS_DIR=str(wheels), DRY_PY=sys.executable),
    )


@needs_package_list
def test_dry_run_passes_with_the_wheels_and_fails_without(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    empty = _dry_run(wheels)
    assert empty.returncode == 1 and "run `bash eval/fetch_gpu_wheels.sh`" in empty.stdout, empty.stdout[-3000:]
    for dist, version in dry.read_pins(os.path.join(REPO_ROOT, "eval", "gpu_wheels.txt")).items():
        _fake_wheel(wheels, dist, version, ["numpy>=1.24", "termcolor", 'pywin32; sys_platform == "win32"'])
    ok = _dry_run(wheels)
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith("dry run: OK"), ok.stdout[-3000:] + ok.stderr[-3000:]
    # a shipped wheel needing something that is neither there nor shipped is refused (it installs with --no-deps)
    _fake_wheel(
        wheels, "hqq", dry.read_pins(os.path.join(REPO_ROOT, "eval", "gpu_wheels.txt"))["hqq"], ["no-such-package-xyz"]
    )
    bad = _dry_run(wheels)
    assert bad.returncode == 1 and "requires no-such-package-xyz" in bad.stdout


def test_pip_calls_must_not_reach_an_index():
    script = "\n".join(
        [
            "python3 -m pip install --no-index --no-deps --target /tmp/x eval/gpu_wheels/*.whl",
            "# pip install anything  (a comment)",
            "pip install hqq",
            "python3 -m pip install --no-index eval/gpu_wheels/a.whl",
            "pip download --no-index hqq",
        ]
    )
    problems = dry.pip_problems(script)
    assert [p.split(" ", 2)[1] for p in problems] == ["3", "4", "5"], problems
    assert "--no-deps" in problems[1]


def test_import_scan_follows_the_project_and_tells_load_time_from_lazy():
    uses, missing = dry.scan_imports(["eval.needle.cli"])
    assert not missing
    eager = {u.name.split(".")[0] for u in uses if u.eager}
    lazy = {u.name.split(".")[0] for u in uses if not u.eager}
    assert {"torch", "transformers", "numpy", "tqdm"} <= eager  # through eval.runner, eval.methods, hf_cocktail
    assert "matplotlib" in lazy and "matplotlib" not in eager  # the heatmaps import it when they draw
    script = (
        "x -m pytest -m gpu tests\n$PY -m eval.benchmarks.bench_kernels --out o\npython -m pip install --no-index y"
    )
    assert dry.script_modules(script) == ["pytest", "gpu", "eval.benchmarks.bench_kernels"]


def test_bench_decode_random_smoke(tmp_path):
    """The end-to-end decode benchmark of the GPU check, on a tiny random Llama on CPU."""
    out = tmp_path / "decode.csv"
    p = subprocess.run(
        [sys.executable, "-m", "eval.benchmarks.bench_decode_random", "--smoke", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = out.read_text().splitlines()
    assert rows[0].startswith("context_tokens,batch,method,prefill_s,decode_ms_per_token")
    methods = {r.split(",")[2] for r in rows[1:]}
    assert {"fp16", "cocktail_mix", "int4", "int2"} <= methods
    assert "FutureWarning" not in p.stderr


def test_bench_kernels_smoke(tmp_path):
    """The kernel benchmark of the GPU check at tiny sizes on CPU (Triton interpreter)."""
    out = tmp_path / "kernels.csv"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "eval.benchmarks.bench_kernels",
            "--smoke",
            "--batches",
            "1",
            "--qcache-backend",
            "torch",
            "--out",
            str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = out.read_text().splitlines()
    assert len(rows) == 1 + 7 and rows[1].split(",")[2] == "fp16_sdpa"  # fp16, 2 qcache, 4 cocktail mixes
    s8_f8 = rows[-1].split(",")
    assert s8_f8[2] == "cocktail_paper_s8_f8" and float(s8_f8[-1]) < 1e-3  # the 8-bit formats read as stored
