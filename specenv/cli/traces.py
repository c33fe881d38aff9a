"""The trace-set commands: ``generate`` (synthetic, paper profile), ``validate`` and ``datasets`` (the shipped sets)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from specenv.cli.common import (
    MAX_GENERATIONS,
    MAX_SEED,
    JsonOpt,
    Traces,
    check_name,
    check_traceset_out,
    fail,
    load_traces,
    out,
    print_json,
)
from specenv.progress import Progress


def generate(
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the trace set to.")],
    profile: Annotated[str, typer.Option(help="Generator profile.")] = "paper",
    generations: Annotated[
        int, typer.Option("--generations", "-n", min=1, max=MAX_GENERATIONS, help="Number of generations.")
    ] = 128,
    kmax: Annotated[int, typer.Option(min=1, max=16, help="Longest draft chain.")] = 10,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Master seed (output is deterministic given it).")] = 0,
    greedy: Annotated[bool, typer.Option(help="Greedy decoding: rho in {0,1} (default: T=0.7 sampling).")] = False,
    rounds: Annotated[bool, typer.Option(help="Also simulate fixed-K runs into a rounds table.")] = True,
    name: Annotated[str, typer.Option(help="Name written to the manifest.")] = "paper-generated",
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Generate a synthetic trace set calibrated to the seed paper."""
    from specenv.generator import generate_paper

    if profile != "paper":
        fail(f"--profile: unknown profile '{profile}' (known: paper)")
    check_name("--name", name)
    check_traceset_out(out_dir, overwrite)
    with Progress("generate", total=generations, unit="generations") as prog:
        ts = generate_paper(
            generations,
            kmax,
            seed=seed,
            greedy=greedy,
            with_rounds=rounds,
            name=name,
            progress=lambda done, total: prog.update(done, total),
        )
    ts.save(out_dir, overwrite=overwrite)
    summary = {"path": str(out_dir), **ts.manifest.counts, "kmax": kmax, "greedy": greedy, "seed": seed}
    if as_json:
        print_json(summary)
    else:
        out.print(f"wrote {out_dir}: " + ", ".join(f"{k}={v}" for k, v in summary.items() if k != "path"))


def validate(traces: Traces, as_json: JsonOpt = False) -> None:
    """Validate a trace set (schema, ranges, hashes); exit 2 with one line on the first problem."""
    ts = load_traces(traces)
    m = ts.manifest
    summary = {
        "name": m.name,
        "version": m.version,
        "source": m.source,
        "profile": m.profile,
        "schema_version": m.schema_version,
        "kmax": m.kmax,
        "greedy": m.greedy,
        "model": {"n_layers": m.model.n_layers, "n_experts": m.model.n_experts, "top_k": m.model.top_k},
        "counts": m.counts,
        "valid": True,
    }
    if as_json:
        print_json(summary)
    else:
        out.print(
            f"{traces}: valid ({m.name} v{m.version}, {m.source}/{m.profile}, Kmax={m.kmax}, "
            + ", ".join(f"{k}={v}" for k, v in m.counts.items())
            + ")"
        )


def datasets(as_json: JsonOpt = False) -> None:
    """List the registered (shipped) trace sets."""
    from specenv.traces.datasets import list_datasets

    rows = [{"id": d.id, "name": d.name, "version": d.version, "description": d.description} for d in list_datasets()]
    if as_json:
        print_json(rows)
    else:
        for r in rows:
            out.print(f"{r['id']}: {r['description']}", markup=False)
        out.print(
            "A name without its version (e.g. paper-default) loads the newest version; "
            "the id with -vN (e.g. paper-default-v2) pins that version.",
            markup=False,
        )
