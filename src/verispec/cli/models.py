"""`verispec models`: the built-in models, whether they are installed and assembled, where they live."""

from __future__ import annotations

from verispec.loaders.builtin import BUILTIN_MODELS, INSTALL_HINT, builtin_status


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list built-in models and their install state",
                       description="List the embedded models: installed (wheels present), assembled "
                                   "(verified GGUF in the cache), size and path.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def run(args) -> int:
    from verispec.cli.main import print_json

    rows = []
    for name, model in BUILTIN_MODELS.items():
        st = builtin_status(name)
        rows.append({"name": name, "role": model.role, "installed": st.installed, "assembled": st.assembled,
                     "size_bytes": st.size, "path": str(st.path), "sha256": model.sha256})
    if args.json:
        print_json(rows)
        return 0
    print(f"{'name':<30} {'role':<7} {'installed':<10} {'assembled':<10} {'size':>9}  path")
    for r in rows:
        print(f"{r['name']:<30} {r['role']:<7} {'yes' if r['installed'] else 'no':<10} "
              f"{'yes' if r['assembled'] else 'no':<10} {r['size_bytes'] / 2**20:>7.0f}MB  {r['path']}")
    from verispec.bench.run import machine_line
    from verispec.kernels import machine

    print(f"\n{machine_line(machine())}")
    if not all(r["installed"] for r in rows):
        print(f"\nto install: {INSTALL_HINT}")
    return 0
