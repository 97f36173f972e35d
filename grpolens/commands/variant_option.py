"""``--variant KEY``: one definition, shared by the commands that read a run's metrics (check, export).

A variant is a what-if recompute of the run (``recompute RUN --set k=v``), kept under
``RUN/grpolens/variants/<key>/`` (:mod:`grpolens.run.variants`). Naming it reads the run's metrics
under the variant's overrides, reusing that variant's per-step cache.
"""

from __future__ import annotations

from typing import Any, Optional

import typer

VARIANT_OPTION: Optional[str] = typer.Option(
    None, "--variant", metavar="KEY",
    help="Use a what-if variant of the run (made by recompute --set/--config): its key, a unique "
         "prefix of it, or its label (e.g. epsilon=0.1); see docs/variants.md.")


def variant_overrides(run: str, spec: Optional[str], set_: list[str]) -> tuple[dict[str, Any], Any]:
    """``(overrides, variant)``: the variant's overrides (``{}`` and None without ``--variant``).
    ``--variant`` with ``--set`` is refused: the variant already fixes the overrides."""
    from grpolens.errors import UserError
    from grpolens.run import format as fmt
    from grpolens.run.variants import find_variant

    if spec is None:
        return {}, None
    if set_:
        raise UserError("--variant and --set: choose one (a variant already fixes the overrides; "
                        "--set alone makes another what-if)")
    v = find_variant(fmt.as_run(run), spec)
    return v.overrides, v
