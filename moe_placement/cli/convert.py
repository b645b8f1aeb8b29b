"""``moe-placement convert``: placements between engine formats, or a trace to the native format."""

from __future__ import annotations

import argparse

from moe_placement.cli.common import (
    CliError,
    check_output,
    check_writes,
    echo,
    ep_size_int,
    hidden_layers_int,
    input_sidecars,
    num_experts_int,
    open_placement,
    open_trace,
    output_files,
)

__all__ = ["add_parser", "cmd_convert"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``convert`` sub-command's arguments (``--format`` choices: :data:`placement.formats.FORMATS`)."""
    from placement.formats import FORMATS

    p = sub.add_parser(
        "convert", help="convert placements between engine formats (or a trace to the native format)"
    )
    p.add_argument("input")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--format", choices=(*FORMATS, "trace"), required=True)
    p.add_argument("--from-format", choices=FORMATS)
    p.add_argument("--ep-size", type=ep_size_int)
    p.add_argument("--num-nodes", type=ep_size_int)
    p.add_argument("--num-logical-experts", type=num_experts_int)
    p.add_argument(
        "--num-hidden-layers", type=hidden_layers_int, help="SGLang: rows in the map (all hidden layers)"
    )
    p.set_defaults(func=cmd_convert)


def _refuse_placement_flags(args: argparse.Namespace) -> None:
    """``--format trace`` copies a trace: the placement flags would be accepted and ignored."""
    for dest in ("from_format", "ep_size", "num_nodes", "num_logical_experts", "num_hidden_layers"):
        if getattr(args, dest) is not None:
            flag = "--" + dest.replace("_", "-")
            raise CliError(
                f"{flag} shapes a placement, but --format trace converts a trace (which keeps its own shape); drop it"
            )


def cmd_convert(args: argparse.Namespace) -> int:
    """Steps: check the output (never the input) -> read (trace or placement, with the shape flags
    given) -> write."""
    if args.format == "trace":
        _refuse_placement_flags(args)
    outputs = [args.output] if args.format == "trace" else output_files(args.output, args.format)
    check_writes(input_sidecars(args.input), outputs)
    out = check_output(args.output)
    assert out is not None  # -o is required
    if args.format == "trace":
        from profiling.readers import write_trace

        trace = open_trace(args.input)
        write_trace(trace, out)
        echo(f"wrote {out} ({trace!r})")
        return 0
    from placement.formats import write_placement

    kw = {
        k: v
        for k, v in (
            ("ep_size", args.ep_size),
            ("num_nodes", args.num_nodes),
            ("num_logical_experts", args.num_logical_experts),
        )
        if v is not None
    }
    if args.from_format:
        kw["format"] = args.from_format
    placement = open_placement(args.input, engine_map=True, **kw)
    written = write_placement(placement, out, args.format, num_hidden_layers=args.num_hidden_layers)
    for p in written:
        echo(f"wrote {p}")
    return 0
