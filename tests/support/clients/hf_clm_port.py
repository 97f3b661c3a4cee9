"""HuggingFace's ``run_clm_no_trainer.py`` (causal language modelling with
Accelerate), ported to parallelx the way docs/accelerate.md shows: a GPT-2
built from a small config (its output layer tied to the token embedding),
AdamW with HuggingFace's decay / no-decay groups, a linear schedule with
warm-up, gradient accumulation, a training-state checkpoint every few steps,
and evaluation on every rank (perplexity from the exact mean loss).

    torchrun --nproc-per-node 2 tests/support/clients/hf_clm_port.py --output_dir OUT
    horovodrun -np 2 python tests/support/clients/hf_clm_port.py --output_dir OUT
    deepspeed --num_gpus 2 tests/support/clients/hf_clm_port.py --output_dir OUT --zero-stage 3
    torchrun --nproc-per-node 2 tests/support/clients/hf_clm_port.py --output_dir OUT --backend fsdp --fsdp-shard auto

What changed from the original: ``Accelerator`` became a parallelx backend
(its options join the script's parser), ``accelerator.prepare`` became
``backend.setup`` and ``backend.make_sampler``, ``accelerator.accumulate`` /
``backward`` / ``optimizer.step()`` / ``lr_scheduler.step()`` /
``optimizer.zero_grad()`` became ``backend.batches`` / ``backend.backward`` /
``backend.step(optimizer, lr_scheduler)``, ``accelerator.gather_for_metrics``
became ``MetricSums``, ``accelerator.save_state`` became
``parallelx.save_training_state``; the dataset is a seeded token stream
instead of a downloaded corpus (no network here), grouped into blocks as the
original groups its tokenized text.  The scheduler counts optimizer steps,
not Accelerate's steps times processes.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

import parallelx


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Finetune a causal language model (a GPT-2 from its config)")
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--checkpointing_steps", type=int, default=5)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=42)
    parallelx.add_arguments(parser)  # --backend, the loop's options, every backend's own
    return parser.parse_args()


def group_texts(tokens: torch.Tensor, block_size: int) -> TensorDataset:
    """The original's group_texts: the token stream cut into blocks, labels = inputs (the model shifts them)."""
    total = (len(tokens) // block_size) * block_size
    blocks = tokens[:total].view(-1, block_size)
    return TensorDataset(blocks, blocks.clone())


def main() -> int:
    args = parse_args()
    with parallelx.from_args(args) as backend:
        # The original sets gradient accumulation on the Accelerator; here it is the backend's loop option.
        backend.set_options(accumulate=args.gradient_accumulation_steps)
        parallelx.seed_everything(args.seed)
        g = torch.Generator().manual_seed(0)
        # A stream with structure to learn: a repeating motif with noise.
        motif = torch.randint(0, 128, (11,), generator=g)
        stream = motif.repeat(200)
        noise = torch.rand(len(stream), generator=g) < 0.15
        stream[noise] = torch.randint(0, 128, (int(noise.sum()),), generator=g)
        train_dataset = group_texts(stream[:1600], args.block_size)
        eval_dataset = group_texts(stream[1600:], args.block_size)

        config = GPT2Config(
            vocab_size=128, n_positions=args.block_size, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=True
        )
        model = GPT2LMHeadModel(config)

        train_sampler = backend.make_sampler(train_dataset, shuffle=True, seed=args.seed)
        train_dataloader = DataLoader(train_dataset, sampler=train_sampler, batch_size=args.per_device_train_batch_size)
        eval_sampler = backend.make_sampler(eval_dataset, shuffle=False)
        eval_dataloader = DataLoader(eval_dataset, sampler=eval_sampler, batch_size=args.per_device_eval_batch_size)

        # The original's split: no decay for biases and LayerNorm weights (as it names them).
        no_decay = ["bias", "layer_norm.weight"]
        optimizer_grouped_parameters = [
            {
                "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
                "weight_decay": args.weight_decay,
            },
            {
                "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
                "weight_decay": 0.0,
            },
        ]
        optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
        model, optimizer = backend.setup(model, optimizer)

        num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
        max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        lr_scheduler = get_scheduler(
            name="linear",
            optimizer=optimizer,
            num_warmup_steps=args.num_warmup_steps,
            num_training_steps=max_train_steps,
        )

        completed_steps = 0
        for epoch in range(args.num_train_epochs):
            model.train()
            for input_ids, labels in backend.batches(train_dataloader):
                with backend.autocast():
                    loss = model(input_ids=input_ids.to(backend.device), labels=labels.to(backend.device)).loss
                backend.backward(loss)
                if backend.step(optimizer, lr_scheduler) is not None:
                    completed_steps += 1
                    if completed_steps % args.checkpointing_steps == 0:
                        parallelx.save_training_state(
                            backend,
                            args.output_dir,
                            step=completed_steps,
                            model=model,
                            optimizer=optimizer,
                            scheduler=lr_scheduler,
                            counters={"epoch": epoch, "completed_steps": completed_steps},
                            keep=100,
                        )

            model.eval()
            losses = parallelx.MetricSums(eval_sampler)
            with torch.no_grad():
                for input_ids, labels in eval_dataloader:
                    logits = model(input_ids=input_ids.to(backend.device)).logits.float()
                    # Each sequence's mean next-token loss, so that every sample counts once.
                    per_token = torch.nn.functional.cross_entropy(
                        logits[:, :-1].reshape(-1, logits.size(-1)),
                        labels[:, 1:].reshape(-1).to(backend.device),
                        reduction="none",
                    )
                    per_sample = per_token.view(len(input_ids), -1).mean(1)
                    losses.update(per_sample, torch.ones_like(per_sample, dtype=torch.bool))
            eval_loss = losses.compute(backend)["loss"]
            backend.print(f"epoch {epoch}: perplexity: {math.exp(eval_loss):.6f} eval_loss: {eval_loss:.6f}")

        backend.save({"model": model, "steps": completed_steps}, args.output_dir / "model.pt")
        backend.print(f"saved {args.output_dir / 'model.pt'} after {completed_steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
