"""An Accelerate-style script, renamed with ``sed 's/\\baccelerate\\b/impel/g'``, imports and runs under impel to the
same numbers as under Accelerate (one process; the multi-rank comparisons live in the compatibility suite)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import json, sys, tempfile
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from accelerate import Accelerator, DistributedType, find_executable_batch_size, init_empty_weights
    from accelerate.logging import get_logger
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.data_loader import skip_first_batches
    from accelerate.utils import (ProjectConfiguration, PrecisionType, gather_object, send_to_device, set_seed,
                                  tqdm, is_tensorboard_available)

    logger = get_logger(__name__)

    def main():
        accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(tempfile.mkdtemp()))
        logger.info(accelerator.state, main_process_only=False)
        assert AcceleratorState().mixed_precision == PrecisionType.NO
        assert PartialState().num_processes == 1
        with init_empty_weights():
            assert torch.nn.Linear(2, 2).weight.is_meta
        set_seed(42)
        x = torch.randn(64, 4)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        pad = 8 if accelerator.distributed_type == DistributedType.XLA else None
        lrs = []

        @find_executable_batch_size(starting_batch_size=32)
        def train(batch_size):
            nonlocal lrs
            if batch_size > 20:
                raise RuntimeError("CUDA out of memory.")
            accelerator.free_memory()
            set_seed(42)
            model = torch.nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            # unshuffled: matching Accelerate's shuffled order is its own task (DESIGN: data order)
            loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
            scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=3 * len(loader))
            model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
            lrs = []
            for epoch in range(3):
                for step, (xb, yb) in enumerate(tqdm(loader, disable=True)):
                    loss = torch.nn.functional.mse_loss(model(xb), yb)
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                    lrs.append(scheduler.get_last_lr()[0])
                if loss.item() > 1e6:
                    accelerator.set_trigger()
                if accelerator.check_trigger():
                    break
            model.eval()
            preds = []
            for xb, yb in skip_first_batches(loader, 1):
                with torch.no_grad():
                    preds += accelerator.gather_for_metrics(model(xb)).flatten().tolist()
            return batch_size, accelerator.unwrap_model(model), preds

        batch_size, model, preds = train()
        accelerator.save(model.state_dict(), tempfile.mktemp(suffix=".bin"))
        weights = [round(v, 6) for v in torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()]
        print(json.dumps({"batch_size": batch_size, "lrs": [round(v, 8) for v in lrs], "weights": weights,
                          "preds": len(gather_object(preds)), "tb": bool(is_tensorboard_available())}))
        accelerator.end_training()

    main()
''')


def run(source: str) -> dict:
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=240,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_renamed_accelerate_script_runs_to_the_same_numbers():
    renamed = re.sub(r"\baccelerate\b", "impel", SCRIPT)
    assert "accelerate" not in renamed
    ours = run(renamed)
    assert ours["batch_size"] == 19 and len(ours["lrs"]) == 3 * 4 and ours["preds"] == 64 - 19
    pytest.importorskip("accelerate")
    theirs = run(SCRIPT)
    assert ours == theirs
