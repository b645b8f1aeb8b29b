"""``moe-placement profile``: run a HF transformers MoE model on text and record its routing.

The model comes from a local folder (or its ``config.json``). With ``*.safetensors`` weights in the
folder they are loaded; otherwise the model gets seeded random weights (routing then says nothing
about the real model, only that the pipeline works). Text is tokenised with the folder's tokenizer,
or, when it has none, with a deterministic byte-level fallback (``id = byte % vocab_size``).
Each text file is cut into sequences of ``--seq-len`` tokens, one prefill forward pass each.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from moe_placement.cli.common import CliError, check_writes, echo, positive_int, progress, seed_int, warn

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile",
        help="run a HF MoE model on text files and record its routing trace",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument(
        "--model",
        required=True,
        help="HF model folder (config.json, optional *.safetensors, tokenizer) or a config.json",
    )
    p.add_argument(
        "--text",
        action="append",
        required=True,
        metavar="FILE",
        help="UTF-8 text file (repeatable; one count window per file)",
    )
    p.add_argument("-o", "--output", required=True, help="trace file to write (.npz, native format)")
    p.add_argument(
        "--mode",
        choices=("counts", "tokens"),
        default="tokens",
        help="tokens: per-token ids (co-activation, drift); counts: per-layer counts per text file",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="stop after this many tokens (all files together)",
    )
    p.add_argument("--seq-len", type=positive_int, default=512, help="tokens per forward pass (default 512)")
    p.add_argument(
        "--seed", type=seed_int, default=0, help="seed for random weights when the folder has none"
    )
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument(
        "--stream-dir", help="tokens mode: stream chunks to this folder (bounded memory on long runs)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def _model_folder(path: str) -> tuple[Path, Path]:
    p = Path(path)
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise CliError(f"model folder {p} has no config.json; pass a HF model folder or its config.json")
        return p, cfg
    if p.is_file():
        return p.parent, p
    raise CliError(f"--model {p} does not exist")


def _load_model(folder: Path, cfg_path: Path, seed: int, device: str):
    import torch
    import transformers

    raw = _read_config(cfg_path)
    try:
        config = transformers.AutoConfig.for_model(**raw)
    except (ValueError, KeyError) as exc:
        raise CliError(
            f"{cfg_path}: model_type {raw.get('model_type')!r} is unknown to transformers {transformers.__version__} ({exc})"
        ) from None
    has_weights = cfg_path.name == "config.json" and any(folder.glob("*.safetensors"))
    if has_weights:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), config=config)
        weights = "pretrained"
    else:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        weights = "random"
    return model.to(device).eval(), config, weights


def _read_config(cfg_path: Path) -> dict:
    """The HF config as a dict, refused (before torch is imported or anything is built) when it is not
    one, states sizes out of range or weights the machine cannot hold
    (:func:`placement.cost.modelspec.check_hf_config_fits`)."""
    from moe_placement.base.fileio import load_json
    from placement.cost.modelspec import check_hf_config_fits

    raw = load_json(cfg_path)
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise CliError(
            f"{cfg_path}: not a HF config (no 'model_type'); write it with the config class's save_pretrained"
        )
    try:
        check_hf_config_fits(raw, str(cfg_path))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return raw


def _tokenizer(folder: Path, cfg_path: Path):
    if cfg_path.name == "config.json" and any((folder / f).is_file() for f in _TOKENIZER_FILES):
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(str(folder))
        return (lambda text: list(tok(text, add_special_tokens=False)["input_ids"])), type(tok).__name__
    return None, "byte-fallback"


def byte_token_ids(data: bytes, vocab_size: int) -> np.ndarray:
    """The deterministic fallback tokenisation: one token per byte, ``id = byte % vocab_size``. int64 ``[n]``."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64) % int(vocab_size)


def _check_paths(args) -> tuple[Path, list[Path], Path | None]:
    """Check the paths -> (output, text files, stream folder or None): the texts regular files, the
    output none of the inputs (the texts, the model's config) and in an existing folder.

    Creates ``--stream-dir`` (it must hold no ``chunk_*.npz`` yet).
    """
    from moe_placement.base.fileio import check_writable_folder, require_regular

    out = Path(args.output)
    texts = [Path(t) for t in args.text]
    for t in texts:
        if not t.exists():
            raise CliError(f"--text {t} does not exist")
        require_regular(t)  # a FIFO or folder is refused instead of read forever
        _check_utf8(t)
    model = Path(args.model)
    model_files = sorted(model.iterdir()) if model.is_dir() else [model]  # config, weights, tokenizer
    check_writes([*texts, *model_files], [out])
    if out.suffix != ".npz":
        raise CliError(f"-o {out}: the trace is written as a native .npz archive; name it {out.stem}.npz")
    stream_dir = Path(args.stream_dir) if args.stream_dir else None
    if stream_dir is not None:
        if args.mode != "tokens":
            raise CliError("--stream-dir streams per-token ids; use --mode tokens")
        try:
            stream_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(
                f"cannot create --stream-dir {stream_dir} ({exc.strerror or exc}); choose another folder"
            ) from None
        check_writable_folder(stream_dir, f"--stream-dir {stream_dir}")
        if any(stream_dir.glob("chunk_*.npz")):
            raise CliError(f"--stream-dir {stream_dir} already holds chunk_*.npz files; give an empty folder")
    return out, texts, stream_dir


def _check_utf8(path: Path, chunk: int = 1 << 20) -> None:
    """``path`` decodes as UTF-8 (read in 1 MiB chunks), else a CliError naming the byte offset."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                raise CliError(
                    f"--text {path}: not UTF-8 text (byte {offset + exc.start} is 0x{block[exc.start]:02x}); "
                    "give plain text files"
                ) from None
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise CliError(
            f"--text {path}: not UTF-8 text (it ends inside a character); give plain text files"
        ) from None


def _check_device(name: str) -> None:
    """``--device`` names a torch device this machine has, else a CliError naming what it has."""
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise CliError(f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise CliError(f"--device {name!r}: profile runs on cpu or cuda, not {dev.type}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise CliError(f"--device {name!r}: this machine has no CUDA device; use --device cpu")
    if dev.index is not None and dev.index >= count:
        raise CliError(
            f"--device {name!r}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
        )


def _open_model(args):
    """The model, its config, ``pretrained``/``random`` weights, the vocabulary size, the encoder (None:
    byte fallback) and the tokenizer's name; warns about the fallbacks."""
    folder, cfg_path = _model_folder(args.model)
    model, config, weights = _load_model(folder, cfg_path, args.seed, args.device)
    vocab = int((getattr(config, "text_config", None) or config).vocab_size)
    encode, tok_name = _tokenizer(folder, cfg_path)
    if encode is None:
        warn(
            f"{folder} has no tokenizer: using the byte-level fallback (token id = byte % {vocab}); "
            "routing on real text needs the model's tokenizer files in the folder"
        )
    if weights == "random":
        warn(
            f"{folder} has no *.safetensors weights: the model has random weights (seed {args.seed}); "
            "the trace shows the pipeline, not the real model's routing"
        )
    return folder, model, config, weights, vocab, encode, tok_name


def _sequences(texts: list[Path], encode, vocab: int, max_tokens: int | None, seq_len: int):
    """Tokenise per file, then cut into sequences: ``[(file index, ids [<= seq_len] int64)]``."""
    budget = max_tokens
    seqs: list[tuple[int, np.ndarray]] = []  # (file index, ids [S])
    for fi, t in enumerate(texts):
        if budget is not None and budget <= 0:
            break
        ids = (
            byte_token_ids(t.read_bytes(), vocab)
            if encode is None
            else np.asarray(encode(t.read_text(encoding="utf-8", errors="replace")), dtype=np.int64)
        )
        if budget is not None:
            ids = ids[:budget]
            budget -= ids.size
        for a in range(0, ids.size, seq_len):
            seqs.append((fi, ids[a : a + seq_len]))
    return seqs


def _forward_all(model, rec, seqs, texts: list[Path], args) -> tuple[list[int], float]:
    """One prefill pass per sequence (a count window per text file in counts mode); detaches ``rec``.

    Returns (tokens per text file, wall seconds).
    """
    import torch

    file_tokens = [0] * len(texts)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            prev = None
            for fi, ids in progress(seqs, total=len(seqs), desc="profile"):
                if args.mode == "counts" and prev is not None and fi != prev:
                    rec.mark_window(texts[prev].stem)
                model(input_ids=torch.as_tensor(ids, device=args.device)[None], use_cache=False)
                file_tokens[fi] += int(ids.size)
                prev = fi
            if args.mode == "counts" and len({fi for fi, _ in seqs}) > 1:
                rec.mark_window(texts[prev].stem)
    finally:
        rec.detach()
    return file_tokens, time.perf_counter() - start


def _with_metadata(trace, name: str, meta: dict):
    """The recorded trace renamed, its metadata extended with ``meta``."""
    from dataclasses import replace

    return replace(trace, name=name, metadata=dict(trace.metadata) | meta)


def _print_summary(summary: dict, trace, wall: float, as_json: bool) -> None:
    """The run's summary as JSON or as two lines (``wall``: unrounded seconds)."""
    if as_json:
        echo(json.dumps(summary, indent=1))
        return
    echo(
        f"profiled {summary['tokens']} tokens in {summary['forward_passes']} forward passes ({wall:.1f}s): "
        f"{len(trace.layer_ids)} MoE layers {list(trace.layer_ids)}, {trace.num_logical_experts} experts, "
        f"top-{summary['top_k']}, {summary['weights']} weights, tokenizer {summary['tokenizer']}"
    )
    echo(f"wrote {summary['output']}")


def run(args: argparse.Namespace) -> int:
    """Steps: check paths -> load model and tokenizer -> tokenise -> record routing -> write -> print."""
    out, texts, stream_dir = _check_paths(args)
    _read_config(_model_folder(args.model)[1])  # sizes checked before torch is imported
    try:
        import torch  # noqa: F401 - checked here so a missing torch is one clear line
    except ImportError as exc:
        raise CliError(
            f"profile needs torch and transformers (pip install torch transformers): {exc}"
        ) from None
    _check_device(args.device)

    from profiling.hooks import RecordOptions, attach
    from profiling.readers import write_trace

    folder, model, config, weights, vocab, encode, tok_name = _open_model(args)
    seqs = _sequences(texts, encode, vocab, args.max_tokens, args.seq_len)
    total = sum(s.size for _, s in seqs)
    if total == 0:
        raise CliError(f"the text files {[str(t) for t in texts]} hold no tokens")
    rec = attach(
        model,
        RecordOptions(
            mode=args.mode,
            capacity_tokens=max(total, 1) if stream_dir is None else 4 * args.seq_len,
            stream_dir=stream_dir,
            chunk_tokens=2 * args.seq_len if stream_dir is not None else None,
        ),
    )
    file_tokens, wall = _forward_all(model, rec, seqs, texts, args)
    name = f"{getattr(config, 'model_type', 'model')}-profile"
    meta = {
        "model": str(folder),
        "model_type": getattr(config, "model_type", None),
        "weights": weights,
        "tokenizer": tok_name,
        "seed": args.seed,
        "seq_len": args.seq_len,
        "text_files": [str(t) for t in texts],
        "file_tokens": file_tokens,
        "synthetic": weights == "random",
    }
    trace = _with_metadata(rec.to_trace(name=name), name, meta)
    write_trace(trace, out)
    summary = {
        "output": str(out),
        "tokens": total,
        "layers": list(trace.layer_ids),
        "experts": trace.num_logical_experts,
        "top_k": rec.top_k,
        "mode": args.mode,
        "weights": weights,
        "tokenizer": tok_name,
        "forward_passes": len(seqs),
        "wall_s": round(wall, 3),
    }
    _print_summary(summary, trace, wall, args.json)
    return 0
