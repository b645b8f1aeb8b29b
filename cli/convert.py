"""``moe-placement convert``: placements between engine formats, or a trace to the native format."""

from __future__ import annotations

import argparse

from cli.common import check_output, echo, open_placement, open_trace

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
    p.add_argument("--ep-size", type=int)
    p.add_argument("--num-nodes", type=int)
    p.add_argument("--num-logical-experts", type=int)
    p.add_argument("--num-hidden-layers", type=int, help="SGLang: rows in the map (all hidden layers)")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    """Steps: check the output -> read (trace or placement, with the shape flags given) -> write."""
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
