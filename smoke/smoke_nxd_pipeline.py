"""nxd-pipeline installed alone: every schedule dry-run without processes, and a GPT captured
with torch.fx and cut into two stages that compute what the model computes."""

import sys

import torch

from nxd_pipeline import (
    SCHEDULE_NAMES,
    build_schedule,
    capture_graph,
    dry_run,
    format_grid,
    partition_graph,
    validate_schedule,
)
from nxd_pipeline._partition import build_stage_module
from nxd_pipeline.testing import Block, TinyGPT


def main() -> None:
    for name in SCHEDULE_NAMES:
        virtual = 2 if name == "interleaved_1f1b" else 1
        schedule = build_schedule(name, 4, 8, virtual)
        validate_schedule(schedule)
        run = dry_run(schedule)
        assert not run.stuck, format_grid(schedule, run)
        assert 0 < run.bubble_fraction() < 1, (name, run.bubble_fraction())

    torch.manual_seed(0)
    model = TinyGPT(layers=4)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    captured = capture_graph(model, leaf_module_cls=(Block,))
    plan = partition_graph(captured, model, ["h.1"], num_stages=2)
    first, second = (build_stage_module(plan, model, stage) for stage in (0, 1))
    inputs = {"input_ids": ids, "labels": ids}
    hidden = first(*(inputs[n] for n in first.input_names))
    loss = second(*tuple(hidden), *(inputs[n] for n in second.input_names))
    # the stages run the model's own modules and ops in the model's order: equal exactly
    torch.testing.assert_close(loss, model(ids, ids), rtol=0, atol=0)
    print("nxd-pipeline smoke: ok", file=sys.stderr)


if __name__ == "__main__":
    main()
