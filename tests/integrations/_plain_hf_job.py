"""A plain Hugging Face Trainer script with no rebalancer import: what `rebalancer run`
monitors unchanged.

Usage: torchrun --nproc-per-node 2 tests/integrations/_plain_hf_job.py OUT_DIR STEPS
Rank 0 prints the final training loss.
"""

import sys
import time

import torch
from transformers import Trainer, TrainingArguments


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        time.sleep(0.02)  # a step long enough for the dashboard to see the job live
        return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), labels)}


out_dir, steps = sys.argv[1], int(sys.argv[2])
args = TrainingArguments(
    output_dir=out_dir, per_device_train_batch_size=4, max_steps=steps, learning_rate=0.01,
    report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True,
    dataloader_num_workers=0, ddp_find_unused_parameters=False,
)
trainer = Trainer(model=Net(), args=args, train_dataset=Data(steps * 8))
result = trainer.train()
if args.process_index == 0:
    print(f"final loss {result.training_loss:.6f}", flush=True)
