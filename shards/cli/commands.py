"""Model commands of the ``ncm`` CLI: pull, import, models, generate.

``agent/cli/main.py`` builds the top-level parser and calls :func:`register`; every subcommand
sets ``func(args) -> int``. A ShardsError becomes one line on stderr and exit status 2.
``python -m shards.cli ...`` runs these commands alone.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from shards.errors import ShardsError
from shards.store.manifest import AUTO_WEIGHTS, WEIGHT_FORMATS

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
WEIGHT_CHOICES = WEIGHT_FORMATS


def _reports_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn a ShardsError into one line on stderr and exit status 2."""

    @functools.wraps(command)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except ShardsError as exc:
            message = " ".join(str(exc).split()) or type(exc).__name__
            print(f"ncm {args.command}: error: {message}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt:
            print(f"ncm {args.command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED

    return wrapper


def _store(args: argparse.Namespace):
    from shards.store.model_store import ModelStore

    return ModelStore(Path(args.home) if getattr(args, "home", None) else None)


def _progress(args: argparse.Namespace) -> bool:
    """Draw progress bars: not with --quiet, nor when stderr is no terminal (logs, systemd, CI)."""
    return not args.quiet and sys.stderr.isatty()


@_reports_errors
def cmd_pull(args: argparse.Namespace) -> int:
    """ncm pull NAME: download a known model and import it."""
    from shards.importers.pull import PULLABLE_ENCODERS, pull_encoder, pull_model, resolve_pull_name, stored_name

    store = _store(args)
    if args.name in PULLABLE_ENCODERS:
        already = store.has_encoder(args.name)
        encoder = pull_encoder(args.name, store, progress=_progress(args))
        print(f"{encoder.name}: {'already present' if already else 'ready'} (embedding model, "
              f"{encoder.hidden_size} dimensions)")
        return EXIT_OK
    source, weights = resolve_pull_name(args.name, args.weights)
    target = stored_name(source.name, weights)
    already = store.has(target)
    manifest = pull_model(args.name, store, weights=args.weights, progress=_progress(args))
    print(f"{manifest.name}: {'already present' if already else 'ready'} ({manifest.weight_format}, "
          f"{manifest.n_layers} layers)")
    return EXIT_OK


@_reports_errors
def cmd_import(args: argparse.Namespace) -> int:
    """ncm import PATH: import a GGUF file or a Hugging Face folder."""
    from shards.importers.encoder import import_encoder, is_encoder_folder
    from shards.importers.encoder_gguf import import_encoder_gguf, is_encoder_gguf
    from shards.importers.importer import default_name, import_model

    path = Path(args.path)
    if not path.exists():
        raise ShardsError(f"{path} does not exist")
    if is_encoder_folder(path) or is_encoder_gguf(path):
        encoder = (import_encoder if path.is_dir() else import_encoder_gguf)(
            path, name=args.name or default_name(path), store=_store(args))
        print(f"{encoder.name}: imported (embedding model, {encoder.hidden_size} dimensions, "
              f"{encoder.pooling} pooling{', normalised' if encoder.normalize else ''})")
        return EXIT_OK
    manifest = import_model(path, name=args.name, weights=args.weights, store=_store(args),
                            progress=_progress(args), lm_head_bits=args.lm_head_bits)
    print(f"{manifest.name}: imported ({manifest.architecture}, {manifest.n_layers} layers, "
          f"{manifest.weight_format})")
    return EXIT_OK


def _human_bytes(size_bytes: int) -> str:
    size = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


@_reports_errors
def cmd_models(args: argparse.Namespace) -> int:
    """ncm models: the models in the store."""
    manifests = _store(args).list()
    if not manifests:
        print("no models yet: run 'ncm pull smollm2-135m' or 'ncm import PATH'")
        return EXIT_OK
    rows = [("NAME", "ARCH", "LAYERS", "WEIGHTS", "SIZE")]
    for m in manifests:
        size_bytes = sum(f.bytes for f in m.files.values())
        rows.append((m.name, m.architecture, str(m.n_layers), m.weight_format, _human_bytes(size_bytes)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return EXIT_OK


@_reports_errors
def cmd_generate(args: argparse.Namespace) -> int:
    """ncm generate MODEL PROMPT: stream a completion to stdout."""
    from shards.runtime.generate import LocalModel, prompt_ids_for
    from shards.runtime.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop or ()))
    store = _store(args)
    store.manifest(args.model)  # ModelNotFoundError before anything heavy
    with LocalModel.open(args.model, store, threads=args.threads) as model:
        ids = prompt_ids_for(model.tokenizer, args.prompt, raw=args.raw, system=args.system)
        final = None
        for event in model.generate(ids, params):
            if event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if event.done:
                final = event
        sys.stdout.write("\n")
        sys.stdout.flush()
    if final is not None and final.usage is not None and args.counts:
        u = final.usage
        decode_rate = (u.completion_tokens - 1) / u.decode_seconds if u.decode_seconds > 0 else 0.0
        print(f"[{final.finish_reason}: {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens, "
              f"prefill {u.prefill_seconds:.2f} s, decode {decode_rate:.1f} tokens/s]", file=sys.stderr)
    return EXIT_OK


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the model subcommands to the ``ncm`` parser's subparsers."""
    home_help = "model store root (default: $NCM_HOME, $XDG_DATA_HOME/ncm or ~/.local/share/ncm)"

    p = subparsers.add_parser("pull", help="download a known model and import it",
                              description="Download a known model (smollm2-135m, gemma3-270m) and import it. "
                              "--weights q4/f16/mixed store it as NAME-q4 / NAME-f16 / NAME-mixed.")
    p.add_argument("name", metavar="NAME", help="model to pull, e.g. smollm2-135m")
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default="f32",
                   help="weight format (default f32; mixed: 4- or 8-bit blocks per tensor, as precise as the file's)")
    p.add_argument("--home", help=home_help)
    p.add_argument("--quiet", action="store_true", help="no progress bars (none either when stderr is no terminal)")
    p.set_defaults(func=cmd_pull, command="pull")

    p = subparsers.add_parser("import", help="import a GGUF file or Hugging Face folder")
    p.add_argument("path", metavar="PATH", help="a .gguf file or a folder with config.json + safetensors")
    p.add_argument("--name", help="name in the store (default: from the file name)")
    p.add_argument("--weights", choices=(*WEIGHT_CHOICES, AUTO_WEIGHTS), default=AUTO_WEIGHTS,
                   help="weight format (default auto: mixed for a quantised GGUF file, f32 for float weights; "
                   "mixed: 4- or 8-bit blocks per tensor, as precise as the file's)")
    p.add_argument("--lm-head-bits", type=int, choices=(8, 4), default=8,
                   help="with --weights q4: the lm_head's bits (default 8; 4 reads fewer bytes per token)")
    p.add_argument("--home", help=home_help)
    p.add_argument("--quiet", action="store_true", help="no progress bars (none either when stderr is no terminal)")
    p.set_defaults(func=cmd_import, command="import")

    p = subparsers.add_parser("models", help="list the models in the store")
    p.add_argument("--home", help=home_help)
    p.set_defaults(func=cmd_models, command="models")

    p = subparsers.add_parser("generate", help="generate text with a stored model on this machine")
    p.add_argument("model", metavar="MODEL", help="model name in the store")
    p.add_argument("prompt", metavar="PROMPT", help="the user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="no chat template: complete PROMPT as plain text")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling cut (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k best tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", help="stop string (repeatable); never printed")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the runtime")
    p.add_argument("--home", help=home_help)
    p.add_argument("-v", "--verbose", dest="counts", action="store_true", help="print token counts and speed to stderr")
    p.set_defaults(func=cmd_generate, command="generate")


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m shards.cli``) with just the model commands."""
    parser = argparse.ArgumentParser(prog="ncm", description="ncm model commands")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)
