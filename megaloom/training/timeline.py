"""The measured pipeline timeline of one step (parallel.timeline_step), drawn with the planning renderer."""

from __future__ import annotations

from pathlib import Path

from megaloom.observe.log import get_logger
from megaloom.parallel import comm
from megaloom.parallel.mesh import Mesh

log = get_logger(__name__)


def draw_measured_timeline(pipe, mesh: Mesh, run_dir: Path, step: int, is_main: bool) -> None:
    """Gather every pipeline rank's timed actions of this step and draw them with the planning renderer."""
    from megaloom.observe.timeline import merge_timelines, render_png, write_chrome_trace

    per_rank = comm.all_gather_objects(pipe.timeline(), mesh.pp_group, recorder=mesh.recorder)
    if not is_main:
        return
    tl = merge_timelines(per_rank)
    s = pipe.schedule
    theory = (s.pp - 1) / (s.vpp * s.microbatches)
    png = render_png(tl, run_dir / f"timeline_step{step}.png",
                     title=f"measured step {step}: {s.name} pp={s.pp} vpp={s.vpp} m={s.microbatches} | bubble "
                           f"{100 * tl.bubble_fraction:.1f}% (idle/compute {tl.bubble_ratio:.3f}, theory {theory:.3f})")
    write_chrome_trace(tl, run_dir / f"timeline_step{step}.json")
    log.info(f"measured pipeline timeline of step {step}: bubble {100 * tl.bubble_fraction:.1f}% of rank time, idle/"
             f"compute {tl.bubble_ratio:.3f} vs theory (p-1)/(v*m) = {theory:.3f}; wrote {png}")
