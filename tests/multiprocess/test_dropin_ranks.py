"""Accelerate's cross-rank helpers on 2 real CPU ranks: check_trigger, synchronize_rng_states, join_uneven_inputs,
the multi-process logger, save, and debug_launcher / notebook_launcher starting ranks themselves."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import IndexDataset
from impel.testing import RankFailed, run_on_ranks

pytestmark = pytest.mark.multiprocess


def _triggers():
    from impel import Accelerator

    acc = Accelerator()
    seen = [acc.check_trigger()]
    if acc.process_index == 1:
        acc.set_trigger()
    seen += [acc.check_trigger(), acc.check_trigger()]
    return seen


def test_a_trigger_set_on_one_rank_fires_on_every_rank():
    assert run_on_ranks(_triggers, 2) == [[False, True, False], [False, True, False]]


def _synced_rngs():
    from impel import Accelerator, synchronize_rng_states

    acc = Accelerator()
    torch.manual_seed(100 + acc.process_index)
    gen = torch.Generator().manual_seed(7 + acc.process_index)
    before = torch.rand(2).tolist()
    synchronize_rng_states(["torch", "generator"], generator=gen)
    return before, torch.rand(2).tolist(), torch.rand(2, generator=gen).tolist()


def test_synchronize_rng_states_gives_every_rank_rank_zeros_state():
    (b0, t0, g0), (b1, t1, g1) = run_on_ranks(_synced_rngs, 2)
    assert b0 != b1 and t0 == t1 and g0 == g1


def _uneven_training(even_batches):
    from impel import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(IndexDataset(5), batch_size=2)  # rank 0: [0,1],[4]; rank 1: [2,3] when uneven
    model, opt, loader = acc.prepare(model, opt, loader)
    steps = 0
    with acc.join_uneven_inputs([model], even_batches=even_batches):
        for batch in loader:
            acc.backward(model(batch.float()).pow(2).mean())
            opt.step()
            opt.zero_grad()
            steps += 1
    return steps, model.module.weight.item(), loader.shard.even_batches


def test_join_uneven_inputs_lets_ranks_run_different_numbers_of_batches():
    (s0, w0, even0), (s1, w1, even1) = run_on_ranks(_uneven_training, 2, args=(False,))
    assert (s0, s1) == (2, 1)
    assert w0 == pytest.approx(w1)  # the joined rank shadowed the all-reduce: replicas stay equal
    assert even0 is even1 is True  # the loaders' setting is restored after the block


def _join_under_fsdp():
    from impel import Accelerator, FullyShardedDataParallelPlugin

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    with acc.join_uneven_inputs([]):
        pass


def test_join_uneven_inputs_refuses_fsdp():
    with pytest.raises(RankFailed, match="join_uneven_inputs works with DDP"):
        run_on_ranks(_join_under_fsdp, 2)


def _log_in_order(tmp):
    from impel import Accelerator
    from impel.logging import get_logger

    logger = get_logger(f"impel.test.ranks.{tmp}")
    handler = logging.FileHandler(f"{tmp}/log.txt")
    logger.logger.addHandler(handler)
    logger.logger.setLevel(logging.INFO)
    acc = Accelerator()
    logger.info("main only")
    logger.info("all ranks", main_process_only=False)
    logger.info(f"ordered {acc.process_index}", in_order=True)
    handler.close()
    return True


def test_logger_on_two_ranks(tmp_path):
    run_on_ranks(_log_in_order, 2, args=(str(tmp_path),))
    lines = (tmp_path / "log.txt").read_text().splitlines()
    assert lines.count("[RANK 0] main only") == 1 and "[RANK 1] main only" not in lines
    assert {"[RANK 0] all ranks", "[RANK 1] all ranks"} <= set(lines)
    ordered = [line for line in lines if "ordered" in line]
    assert ordered == ["[RANK 0] ordered 0", "[RANK 1] ordered 1"]


def _write_rank_file(out_dir, tag):
    from impel import Accelerator

    acc = Accelerator()
    total = acc.reduce(torch.tensor([acc.process_index + 1.0])).item()
    acc.save({"total": torch.tensor(total)}, f"{out_dir}/{tag}_saved.pt")
    with open(f"{out_dir}/{tag}_{acc.process_index}.txt", "w") as f:
        f.write(f"{acc.num_processes} {acc.device.type} {total} {acc.mixed_precision} {acc.distributed_type}")


def test_debug_launcher_runs_the_function_on_cpu_ranks(tmp_path):
    from impel import debug_launcher

    debug_launcher(_write_rank_file, args=(str(tmp_path), "debug"), num_processes=2)
    for rank in (0, 1):
        assert (tmp_path / f"debug_{rank}.txt").read_text() == "2 cpu 3.0 no MULTI_CPU"
    assert torch.load(tmp_path / "debug_saved.pt", weights_only=True)["total"].item() == 3.0


def test_notebook_launcher_passes_mixed_precision_to_the_ranks(tmp_path):
    from impel import notebook_launcher

    notebook_launcher(_write_rank_file, args=(str(tmp_path), "nb"), num_processes=2, mixed_precision="bf16",
                      use_port=0)
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    multi = "MULTI_GPU" if kind == "cuda" else "MULTI_CPU"
    for rank in (0, 1):
        assert (tmp_path / f"nb_{rank}.txt").read_text() == f"2 {kind} 3.0 bf16 {multi}"


def _fails():
    from impel import Accelerator

    if Accelerator().process_index == 1:
        raise ValueError("rank 1 broke")


def test_debug_launcher_reports_a_failing_rank():
    from impel import debug_launcher

    with pytest.raises(Exception, match="_fails|ChildFailedError|rank 1 broke"):
        debug_launcher(_fails, num_processes=2)
