"""What a DDP script does, run unchanged under hpcps.init: lines after the loop, unguarded, run on the workers alone."""

from __future__ import annotations

import re
import sys
import textwrap

import torch

from launching import failure, launch, needs_mpiexec

AFTER_THE_LOOP = textwrap.dedent("""
    import sys, torch, hpcps
    torch.manual_seed(0)
    ps = hpcps.init(lambda: torch.nn.Linear(4, 2), optimizer="adamw", lr=0.01, paradigm="bsp", steps=4,
                    progress=False, out=sys.argv[1])
    while ps.running:  # a DDP script's loop: no `with ps:`, no close
        ps.optimizer.zero_grad()
        loss = ps.model(torch.randn(8, 4).to(ps.device)).pow(2).mean()
        loss.backward()
        ps.optimizer.step(loss=loss)
    # a DDP script's tail, unguarded (no `if rank == 0`): on a server rank the process ended in init
    state = ps.optimizer.state_dict()
    ps.optimizer.load_state_dict(state)
    torch.save({"model": ps.model.state_dict(), "optimizer": state}, f"{sys.argv[2]}.{ps.rank}.pt")
    print(f"TAIL ran on rank {ps.rank}", flush=True)
""")


@needs_mpiexec
def test_a_script_that_touches_its_optimizer_after_the_loop_ends_with_status_0_on_every_rank(tmp_path):
    """Before, rank 0 (a server) ran the tail too: ps.optimizer.load_state_dict raised there after training had
    succeeded, and the job's status was 1. Now the server ranks end in init once they have served (status 0),
    and the two workers save the servers' AdamW state after 4 steps (step 4 in every parameter's state)."""
    script = tmp_path / "ddp_tail.py"
    script.write_text(AFTER_THE_LOOP)
    done = launch(3, sys.executable, str(script), str(tmp_path / "run.h5"), str(tmp_path / "saved"), timeout=120)
    assert done.returncode == 0, failure(done.stderr)
    # (found in the stream, not by line: unbuffered, print writes its text and its newline apart, and the
    # launcher can put another rank's line between them)
    assert sorted(re.findall(r"TAIL ran on rank \d+", done.stdout)) == ["TAIL ran on rank 1", "TAIL ran on rank 2"]
    assert not (tmp_path / "saved.0.pt").exists()
    for rank in (1, 2):
        saved = torch.load(tmp_path / f"saved.{rank}.pt")
        assert sorted(saved["model"]) == ["bias", "weight"]
        assert [float(s["step"]) for s in saved["optimizer"]["state"].values()] == [4.0, 4.0]
    assert (tmp_path / "run.h5").exists()
