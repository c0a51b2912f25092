"""`verispec` command line: generate, chat, serve, models, bench, verify, profile, loadtest, train-head."""

from __future__ import annotations

import argparse
import json
import sys

from verispec.errors import VerispecError


def main(argv: list[str] | None = None) -> int:
    from verispec.cli import bench, chat, generate, loadtest, models, profile, serve, train_head, verify

    parser = argparse.ArgumentParser(
        prog="verispec",
        description="Lossless speculative decoding for local LLMs: faster, with the same output.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    generate.add_parser(sub)
    chat.add_parser(sub)
    serve.add_parser(sub)
    loadtest.add_parser(sub)
    models.add_parser(sub)
    bench.add_parser(sub)
    verify.add_parser(sub)
    profile.add_parser(sub)
    train_head.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        from verispec import kernels

        kernels.settings()          # a misspelt VERISPEC_KERNEL* setting stops every command before it starts
        return args.run(args)
    except VerispecError as exc:
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nverispec: interrupted", file=sys.stderr)
        return 130


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    sys.exit(main())
