"""What an agent's operator allows a coordinator to ask of it.

An agent runs the commands of whoever holds the join token (and, with TLS, a certificate the
agent trusts): without a policy that would mean importing any module with any kwargs, reading
any file and writing anywhere. So an agent refuses, and reports the refusal naming the rule:

* a model entrypoint that matches none of `--allow-entrypoint` (fnmatch patterns on
  "module:function"); with none given, only the built-in GPT runs;
* a `data.path` outside every `--data-root`; with none given, only the built-in text;
* a checkpoint, snapshot or restore directory outside every `--checkpoint-root` and the agent's
  own work dir.

The agents `up` starts on its own machine run the user's own YAML: `up` allows exactly its
entrypoint, data file and checkpoint directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.entrypoint_patterns import entrypoint_allowed


class PolicyRefusal(ValueError):
    """A command this agent's operator did not allow, with the rule that refused it."""


def _under(path: str, roots: tuple[Path, ...]) -> bool:
    resolved = Path(path).resolve()
    return any(resolved == root or resolved.is_relative_to(root) for root in roots)


@dataclass(frozen=True)
class AgentPolicy:
    entrypoints: tuple[str, ...] = ()
    data_roots: tuple[Path, ...] = ()
    checkpoint_roots: tuple[Path, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, entrypoints, data_roots, checkpoint_roots, work_dir: Path) -> AgentPolicy:
        return cls(tuple(entrypoints), tuple(Path(p).resolve() for p in data_roots),
                   tuple(Path(p).resolve() for p in (*checkpoint_roots, work_dir)))

    def check_model(self, model: pb.ModelSpec) -> None:
        if not model.HasField("entrypoint"):
            return  # the built-in GPT: hetlaunch's own code
        name = model.entrypoint.entrypoint
        if not entrypoint_allowed(name, self.entrypoints):
            allowed = ", ".join(self.entrypoints) or "none: only the built-in GPT"
            raise PolicyRefusal(f"refused by this agent's policy: model entrypoint {name!r} is not allowed "
                                f"(--allow-entrypoint: {allowed})")

    def check_run_stage(self, run: pb.RunStage) -> None:
        """The model and the data (before anything is fetched for the stage)."""
        self.check_model(run.model)
        if run.data.path and not _under(run.data.path, self.data_roots):
            roots = ", ".join(map(str, self.data_roots)) or "none: only the built-in text"
            raise PolicyRefusal(f"refused by this agent's policy: data.path {run.data.path!r} is outside every "
                                f"--data-root ({roots})")

    def check_paths(self, run: pb.RunStage) -> None:
        """Where the stage will write and read checkpoints (after an uploading agent has moved them
        into its work dir)."""
        for what, path in (("checkpoint directory", run.train.checkpoint_dir),
                           ("snapshot directory", run.train.snapshot_dir),
                           ("restore directory", run.restore.checkpoint_dir if run.HasField("restore") else "")):
            if path and not _under(path, self.checkpoint_roots):
                raise PolicyRefusal(f"refused by this agent's policy: {what} {path!r} is outside every "
                                    f"--checkpoint-root ({', '.join(map(str, self.checkpoint_roots))})")
