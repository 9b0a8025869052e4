"""One user process of a user_workers job, as the tests start it: a linear
model fitted through fulcrum.torch, reporting each step and each epoch.

    user_worker.py JOB_ID MODE STEPS_PER_EPOCH [SLEEP_S]

MODE: train (every epoch, then finished), forever (trains until stopped),
raise (a ValueError at step 3). Exits 0 when finished, 3 when stopped by the
coordinator (WorkerStopped). The coordinator and the worker certificate come
from $FULCRUM_COORDINATOR and $FULCRUM_TLS_{CA,CERT,KEY}_FILE.
"""
import sys
import time

import torch

import fulcrum
import fulcrum.torch as ftorch

job_id, mode, steps_per_epoch = sys.argv[1], sys.argv[2], int(sys.argv[3])
pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0

try:
    with fulcrum.Worker(job_id, timeout=120, report_interval=0.2) as w:
        print(f"rank {w.rank} of {w.world_size} incarnation {w.incarnation} start_step {w.start_step}", flush=True)
        torch.manual_seed(100 + w.rank)
        true_w = torch.arange(1, 9, dtype=torch.float32).reshape(8, 1) / 8
        x = torch.randn(64 * steps_per_epoch, 8)
        y = x @ true_w
        test_x = torch.randn(256, 8)
        test_y = test_x @ true_w
        model = torch.nn.Linear(8, 1)
        opt = ftorch.ParameterServerOptimizer(model, w)
        epochs = w.spec.epochs if mode != "forever" else 1_000_000
        total = epochs * steps_per_epoch
        step = w.start_step
        while step < total:
            epoch, i = divmod(step, steps_per_epoch)
            xb, yb = x[i * 64:(i + 1) * 64], y[i * 64:(i + 1) * 64]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            step += 1
            if mode == "raise" and step == 3:
                raise ValueError("the user's model diverged at step 3")
            w.report(step, epoch, loss=loss.item(), samples_per_second=64 / max(pause, 1e-3), total_steps=total)
            if step % steps_per_epoch == 0:
                with torch.no_grad():
                    test_loss = torch.nn.functional.mse_loss(model(test_x), test_y).item()
                w.epoch_done(epoch, train_loss=loss.item(), test_loss=test_loss if w.rank == 0 else None,
                             step=step)
                print(f"epoch {epoch} step {step} test_loss {test_loss:.5f}", flush=True)
            time.sleep(pause)
        print("finished", flush=True)
except fulcrum.WorkerStopped as e:
    print(f"stopped: {e}", flush=True)
    sys.exit(3)
