"""Metric trackers for train_fsdp.py's --tensorboard and --wandb. The trainer imports this file
only when one is asked for: copy it beside the trainer to use those flags in your repo. Each
tracker has a name, log(step, scalars) and close(); a resume continues the same run."""

import json
import os


class Trackers:
    """The trackers asked for, on rank 0, sent each record of metrics.jsonl. One that fails
    (network, disk) is said once and dropped: the run goes on without it."""

    def __init__(self, config, start_step, say, records):
        """config: the run's settings as a dict; say: prints a line into the run's log; records:
        metrics.jsonl's, which a resumed W&B run may lack."""
        self.say, self.runs, self.sent_step, self.sent_keys = say, [], None, set()
        t = config["train"]
        for wanted, kind in ((t["tensorboard"], TensorBoardRun), (t["wandb"], WandbRun)):
            try:
                if wanted:
                    self.runs.append(kind(config, start_step, records))
            except Exception as e:
                say(f"{kind.name} could not start ({type(e).__name__}: {e}); training goes on "
                    "without it")

    def log(self, record):
        step = record["step"]  # each key once a step: a validation at a log step repeats one
        if step != self.sent_step:
            self.sent_step, self.sent_keys = step, set()
        scalars = {k: v for k, v in numbers(record).items() if k not in self.sent_keys}
        self.sent_keys |= set(scalars)
        for run in list(self.runs):
            self.call(run, f"failed at step {step}", run.log, step, scalars)

    def close(self):
        for run in list(self.runs):
            self.call(run, "failed to close", run.close)
        self.runs = []

    def call(self, run, what, fn, *args):
        try:
            fn(*args)
        except Exception as e:
            self.runs.remove(run)
            self.say(f"{run.name} {what} ({type(e).__name__}: {e}); training goes on without it")


def numbers(record):
    """A record's numbers but its step: what the trackers plot."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


class TensorBoardRun:
    """Event files in RUN_DIR/tensorboard; tags are the keys of metrics.jsonl."""
    name = "TensorBoard"

    def __init__(self, config, start_step, records):
        from torch.utils.tensorboard import SummaryWriter
        # purge_step: TensorBoard hides earlier event files' values from this step on, as
        # metrics.jsonl drops them.
        self.writer = SummaryWriter(os.path.join(config["train"]["out_dir"], "tensorboard"),
                                    purge_step=start_step + 1)
        text = "    " + json.dumps(config, indent=1).replace("\n", "\n    ")  # Markdown code
        self.writer.add_text("config", text, start_step)

    def log(self, step, scalars):
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self):
        self.writer.close()


class WandbRun:
    """A W&B run in RUN_DIR/wandb. W&B takes no step twice and writes in blocks: wandb_run.json
    holds the run's id and the last step it surely holds (written at close); a resume sends what
    it lacks from metrics.jsonl first. Offline: `wandb sync RUN_DIR/wandb/offline-run-*`."""
    name = "W&B"
    STATE = "wandb_run.json"

    def __init__(self, config, start_step, records):
        import wandb
        run_dir = config["train"]["out_dir"]
        self.state, saved = os.path.join(run_dir, self.STATE), {}
        if start_step and os.path.exists(self.state):
            with open(self.state) as fh:
                saved = json.load(fh)
        # console off: the trainer's own output stays as it is (training_log.txt has it all).
        self.run = wandb.init(project=config["train"]["wandb"], id=saved.get("id"), resume="allow",
                              dir=run_dir, name=os.path.basename(os.path.abspath(run_dir)),
                              config=config, allow_val_change=True,
                              settings=wandb.Settings(console="off"))
        self.last = self.held = saved.get("step", 0)
        self.save()
        by_step = {}  # the numbers of the records of the steps W&B lacks, one dict per step
        for record in records:
            if self.held < record.get("step", 0) <= start_step:
                by_step.setdefault(record["step"], {}).update(numbers(record))
        for step in sorted(by_step):
            self.log(step, by_step[step])

    def log(self, step, scalars):
        if step > self.held:
            self.run.log(scalars, step=step)
            self.last = step

    def save(self):
        with open(self.state + ".tmp", "w") as fh:
            json.dump({"id": self.run.id, "step": self.last}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(self.state + ".tmp", self.state)

    def close(self):
        self.run.finish()
        self.save()
