"""How far each GGUF type moves a model, in ncm's stores and in llama.cpp, against the float model.

    python bench/gguf_kl.py --llama-bin DIR        # DIR holds llama-quantize and llama-perplexity
    python bench/gguf_kl.py --llama-bin DIR --types Q4_0,Q8_0 --chunks 4 --stores mixed

The float model: the default model's weights (its Q4_1 file, dequantised) moved off the 4-bit
grid by Gaussian noise of about the grid's own rounding error (``--noise`` times each row's
spread), written as an F32 GGUF: realistic weights that no type holds exactly. llama.cpp's
``llama-quantize`` writes each type from it (the stock mix of each type: tensors whose rows are
not a multiple of 256 fall back to the type llama.cpp picks for them). Then, per type:

- llama.cpp: ``llama-perplexity --kl-divergence`` of the type's file against the F32 file's
  logits (``--kl-divergence-base``), ``--chunks`` windows of ``--ctx`` tokens of the text, the
  second half of each window scored (its own procedure);
- ncm: each store of the type's file (``--stores``: f32, exact; mixed, ``ncm import``'s default, the file's
  precision at about its size; q4) against the F32 file's f32 store, over the same windows,
  scored the same way: mean KL divergence, and the store's bytes over the file's tensor bytes.

Prints a table with the ratio ncm / llama.cpp per type and store (aim <= 1.05 for mixed) and
the size ratio (aim <= 1.15).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.gguf_reference import gguf_tensor_bytes  # noqa: E402 - after the path
from bench.model_shapes import cache_dir, default_tokenizer_gguf  # noqa: E402
from shards.importers.importer import import_model  # noqa: E402
from shards.runtime.chain import chain_forward, open_chain  # noqa: E402
from shards.store.model_store import ModelStore  # noqa: E402
from shards.text.tokenizer import Tokenizer  # noqa: E402

TYPES = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
SEED = 31


def write_float_gguf(source: Path, path: Path, noise: float) -> Path:
    """``source``'s model with every weight dequantised to float32 and each 2-D weight's rows
    moved by Gaussian noise of ``noise`` times the row's standard deviation."""
    import gguf

    reader = gguf.GGUFReader(source)
    rng = np.random.default_rng(SEED)
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        writer.add_key_value(key, field.contents(), field.types[0],
                             sub_type=field.types[-1] if len(field.types) > 1 else None)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        weights = weights.reshape([int(n) for n in reversed(tensor.shape)])
        if weights.ndim == 2:
            spread = weights.std(axis=1, keepdims=True)
            weights = weights + (noise * spread * rng.standard_normal(weights.shape)).astype(np.float32)
        writer.add_tensor(tensor.name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def windows(ids: list[int], ctx: int, chunks: int) -> list[np.ndarray]:
    return [np.array(ids[i * ctx:(i + 1) * ctx], np.int64) for i in range(min(chunks, len(ids) // ctx))]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def scored_log_probs(store: ModelStore, name: str, chunks: list[np.ndarray], threads: int) -> list[np.ndarray]:
    """Per window, the log-probabilities of its second half's positions (each window alone)."""
    with tempfile.TemporaryDirectory(prefix="ncm-bench-") as cache:
        last = store.manifest(name).n_layers - 1
        runners = open_chain(store.model_dir(name), [(0, last)], threads=threads, cache_dir=Path(cache))
        try:
            rows = []
            for index, chunk in enumerate(chunks):
                logits = chain_forward(runners, f"kl{index}", chunk)[0]
                for r in runners:
                    r.close_session(f"kl{index}")
                rows.append(log_softmax(logits[len(chunk) // 2:].astype(np.float64)))
            return rows
        finally:
            for r in runners:
                r.close()


def mean_kl(reference: list[np.ndarray], other: list[np.ndarray]) -> float:
    return float(np.mean(np.concatenate([(np.exp(p) * (p - q)).sum(axis=-1) for p, q in zip(reference, other)])))


def llama_kl(binary: Path, gguf_path: Path, base: Path, text: Path, ctx: int, chunks: int, threads: int,
             *, write_base: bool = False) -> float | None:
    """llama-perplexity's mean KL divergence of ``gguf_path`` against the logits in ``base``
    (with ``write_base``: writes them from ``gguf_path`` instead, and returns None)."""
    command = [str(binary), "-m", str(gguf_path), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks),
               "-t", str(threads), "-b", str(ctx), "--kl-divergence-base", str(base)]
    done = subprocess.run(command + ([] if write_base else ["--kl-divergence"]), capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {done.stderr[-2000:]}")
    if write_base:
        return None
    found = re.search(r"Mean\s+KLD:\s+(-?[0-9.]+)", done.stdout + done.stderr)
    if found is None:
        raise RuntimeError(f"no mean KLD in llama-perplexity's output: {(done.stdout + done.stderr)[-2000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-quantize and llama-perplexity")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--stores", default="f32,mixed,q4")
    parser.add_argument("--text", type=Path, default=REPO_ROOT / "docs" / "architecture.md")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.12, help="off-grid noise, in each row's standard deviations")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    perplexity, quantize = args.llama_bin / "llama-perplexity", args.llama_bin / "llama-quantize"
    with tempfile.TemporaryDirectory(prefix="ncm-bench-") as tmp:
        folder = Path(tmp)
        store = ModelStore(folder / "home")
        base = write_float_gguf(default_tokenizer_gguf(cache_dir()), folder / "float.gguf", args.noise)
        import_model(base, name="float", weights="f32", store=store, progress=False)
        tokenizer = Tokenizer.from_model_dir(store.model_dir("float"))
        chunks = windows(tokenizer.encode(args.text.read_text(encoding="utf-8")), args.ctx, args.chunks)
        reference = scored_log_probs(store, "float", chunks, args.threads)
        llama_kl(perplexity, base, folder / "float.kld", args.text, args.ctx, len(chunks), args.threads,
                 write_base=True)
        print(f"the float model: {args.noise} row deviations off the default model's grid; {len(chunks)} windows of "
              f"{args.ctx} tokens of {args.text.name}, the second half of each scored")
        print("| type | file tensor MiB | llama.cpp KL | store | ncm KL | ncm / llama.cpp | store / file bytes |")
        print("|---|---|---|---|---|---|---|")
        for kind in args.types.split(","):
            quantized = folder / f"{kind}.gguf"
            subprocess.run([str(quantize), str(base), str(quantized), kind, str(args.threads)], check=True,
                           capture_output=True, timeout=3600)
            theirs = llama_kl(perplexity, quantized, folder / "float.kld", args.text, args.ctx, len(chunks),
                              args.threads)
            file_bytes = gguf_tensor_bytes(quantized)
            for weights in args.stores.split(","):
                name = f"{kind.lower()}-{weights}"
                manifest = import_model(quantized, name=name, weights=weights, store=store, progress=False)
                ours = mean_kl(reference, scored_log_probs(store, name, chunks, args.threads))
                stored = sum(f.bytes for f in manifest.files.values())
                print(f"| {kind} | {file_bytes / 2**20:.1f} | {theirs:.5f} | {weights} | {ours:.5f} | "
                      f"{ours / theirs:.2f} | {stored / file_bytes:.2f} |", flush=True)
                store.remove(name)


if __name__ == "__main__":
    main()
