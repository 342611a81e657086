"""transformers' ``run_clm_no_trainer.py``, shrunk: a tiny GPT-2 trained from scratch on a synthetic token stream.

Written as an Accelerate user writes it (``tests/multiprocess/test_compat_scripts.py`` runs it as is under torchrun,
and renamed to impel under ``impel launch``): ``--max_train_steps`` sizing with the scheduler built for
``max_train_steps * num_processes`` (transformers' sizing for Accelerate's scheduler stepping), ``save_state`` every
``--checkpointing_steps`` into ``step_N`` directories, ``--resume_from_checkpoint`` with ``load_state`` and
``skip_first_batches`` as the script does it, perplexity from ``gather_for_metrics(loss.repeat(batch_size))``,
``accelerator.save(unwrapped.state_dict(), ...)``, ``find_executable_batch_size`` finding the batch size after two
(simulated) out-of-memory errors, and early stopping across ranks with ``set_trigger`` / ``check_trigger``.

Prints one line ``COMPAT {json}`` on the main process: the learning rate after every optimizer step, the final
parameters (as saved by ``accelerator.save``) and the metrics of every epoch.
"""
import argparse
import json
import math
import os
import random

import torch
from accelerate import Accelerator, DistributedType
from accelerate.logging import get_logger
from accelerate.utils import find_executable_batch_size, set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

logger = get_logger(__name__)
VOCAB, BLOCK_SIZE = 48, 16


def parse_args():
    parser = argparse.ArgumentParser(description="A tiny run_clm_no_trainer.")
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16, help="the first one to try")
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--lr_scheduler_type", type=str, default="linear")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--checkpointing_steps", type=str, default=None)
    parser.add_argument("--resume_from_checkpoint", type=str, default=None, help="a step_N directory, or 'latest'")
    parser.add_argument("--stop_after_step", type=int, default=None,
                        help="the last rank asks every rank to stop after this optimizer step (early stopping)")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def token_stream(num_tokens, seed):
    """Counting runs with random starts and strides: predictable enough that the loss falls."""
    rng, tokens = random.Random(seed), []
    while len(tokens) < num_tokens:
        start, stride = rng.randrange(VOCAB), rng.choice([1, 2, 3])
        tokens += [(start + stride * i) % VOCAB for i in range(rng.randint(4, 12))]
    return tokens[:num_tokens]


def group_texts(tokens):
    """Chunks of BLOCK_SIZE tokens, the labels a copy of the inputs (the model shifts them)."""
    total_length = (len(tokens) // BLOCK_SIZE) * BLOCK_SIZE
    return [{"input_ids": tokens[i:i + BLOCK_SIZE], "attention_mask": [1] * BLOCK_SIZE,
             "labels": tokens[i:i + BLOCK_SIZE]} for i in range(0, total_length, BLOCK_SIZE)]


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    logger.info(accelerator.state, main_process_only=False)
    if args.seed is not None:
        set_seed(args.seed)
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    with accelerator.main_process_first():
        train_dataset = group_texts(token_stream(24 * BLOCK_SIZE, seed=3))
        eval_dataset = group_texts(token_stream(10 * BLOCK_SIZE, seed=4))

    @find_executable_batch_size(starting_batch_size=args.per_device_train_batch_size)
    def inner_training_loop(batch_size):
        if batch_size > 4:  # what a too-large batch does on a small GPU, without the GPU
            raise RuntimeError(f"CUDA out of memory. Tried to allocate a batch of {batch_size} (simulated)")
        accelerator.free_memory()
        set_seed(args.seed)
        # dropout off: a resume under Accelerate is not exact with it (the resumed pass draws its worker seed
        # from the global RNG that load_state just restored, shifting every later dropout mask), impel's is
        config = GPT2Config(vocab_size=VOCAB, n_positions=BLOCK_SIZE, n_embd=32, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)

        train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                      batch_size=batch_size)
        eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                     batch_size=args.per_device_eval_batch_size)

        no_decay = ["bias", "layer_norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
        optimizer_grouped_parameters = [
            {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
             "weight_decay": args.weight_decay},
            {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

        # Scheduler and math around the number of training steps, as transformers writes it: with
        # --max_train_steps given, the schedule is sized for a scheduler that steps num_processes times per
        # optimizer step (Accelerate's AcceleratedScheduler)
        overrode_max_train_steps = False
        num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
        max_train_steps = args.max_train_steps
        if max_train_steps is None:
            max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
            overrode_max_train_steps = True
        lr_scheduler = get_scheduler(
            name=args.lr_scheduler_type, optimizer=optimizer,
            num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
            num_training_steps=max_train_steps if overrode_max_train_steps
            else max_train_steps * accelerator.num_processes)

        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
        if accelerator.distributed_type == DistributedType.XLA:
            model.tie_weights()

        # the prepared loader is shorter (one shard per rank): recompute the sizes from it
        num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
        if overrode_max_train_steps:
            max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        num_train_epochs = math.ceil(max_train_steps / num_update_steps_per_epoch)

        checkpointing_steps = args.checkpointing_steps
        if checkpointing_steps is not None and checkpointing_steps.isdigit():
            checkpointing_steps = int(checkpointing_steps)

        completed_steps, starting_epoch, resume_step = 0, 0, None
        if args.resume_from_checkpoint:
            checkpoint_path = args.resume_from_checkpoint
            if checkpoint_path == "latest":  # the newest step_N under output_dir
                steps = [int(d.split("_")[1]) for d in os.listdir(args.output_dir) if d.startswith("step_")]
                checkpoint_path = os.path.join(args.output_dir, f"step_{max(steps)}")
            path = os.path.basename(checkpoint_path)
            accelerator.print(f"Resumed from checkpoint: {checkpoint_path}")
            accelerator.load_state(checkpoint_path)
            training_difference = os.path.splitext(path)[0]
            if "epoch" in training_difference:
                starting_epoch = int(training_difference.replace("epoch_", "")) + 1
                completed_steps = starting_epoch * num_update_steps_per_epoch
            else:
                # the step counts optimizer steps: times gradient_accumulation_steps gives batches
                resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
                starting_epoch = resume_step // len(train_dataloader)
                completed_steps = resume_step // args.gradient_accumulation_steps
                resume_step -= starting_epoch * len(train_dataloader)

        lrs, epochs, stopped = [], [], False
        for epoch in range(starting_epoch, num_train_epochs):
            model.train()
            total_loss = 0.0
            if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
                # skip the batches the checkpointed run already trained on
                active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            else:
                active_dataloader = train_dataloader
            for batch in active_dataloader:
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    loss = outputs.loss
                    total_loss += loss.detach().float().item()
                    accelerator.backward(loss)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()

                if accelerator.sync_gradients:
                    completed_steps += 1
                    lrs.append(lr_scheduler.get_last_lr()[0])

                if isinstance(checkpointing_steps, int):
                    if completed_steps % checkpointing_steps == 0 and accelerator.sync_gradients:
                        accelerator.save_state(os.path.join(args.output_dir, f"step_{completed_steps}"))

                # early stopping: any one rank may decide; every rank learns it from check_trigger()
                if args.stop_after_step is not None and completed_steps >= args.stop_after_step \
                        and accelerator.process_index == accelerator.num_processes - 1:
                    accelerator.set_trigger()
                if accelerator.check_trigger():
                    stopped = True
                    break
                if completed_steps >= max_train_steps:
                    break

            model.eval()
            losses = []
            for batch in eval_dataloader:
                with torch.no_grad():
                    outputs = model(**batch)
                loss = outputs.loss
                losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
            losses = torch.cat(losses)
            try:
                eval_loss = torch.mean(losses)
                perplexity = math.exp(eval_loss)
            except OverflowError:
                perplexity = float("inf")
            logger.info(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
            epochs.append({"epoch": epoch, "perplexity": perplexity, "eval_loss": eval_loss.item(),
                           "eval_samples": losses.numel(), "train_loss": total_loss, "step": completed_steps})
            if stopped:
                break
        return lrs, epochs, model, stopped, batch_size

    lrs, epochs, model, stopped, batch_size = inner_training_loop()

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    weights_file = os.path.join(args.output_dir, "pytorch_model.bin")
    accelerator.save(unwrapped_model.state_dict(), weights_file)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        saved = torch.load(weights_file, weights_only=True)
        params = torch.cat([saved[name].float().flatten() for name in sorted(saved)])
        accelerator.print("COMPAT " + json.dumps({
            "script": "clm_no_trainer", "num_processes": accelerator.num_processes, "batch_size": batch_size,
            "stopped_early": stopped, "checkpoints": sorted(d for d in os.listdir(args.output_dir)
                                                            if d.startswith("step_")),
            "lrs": lrs, "params": params.tolist(), "metrics": epochs}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
