"""How every role loads the model's files: ``model.revision`` and ``model.trust_remote_code`` as one typed message.

The driver (tokenizer, checks), the train ranks (policy, reference, configs) and the rollout engines all load the
same model; each is given a :class:`ModelSource` and passes :meth:`ModelSource.hf_kwargs` to every
``from_pretrained`` (transformers, PEFT); an engine with a loader of its own maps the same two options onto it (vLLM:
``rollout_workers.vllm.config.source_kwargs``). No project imports: every role may use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ModelSource"]


@dataclass(frozen=True)
class ModelSource:
    """The spec's model loading options.

    Attributes:
        revision: git revision (branch, tag or commit) of a hub model (``model.revision``); None: the default branch.
            Applies to hub ids only: a local folder (the built-in model, a checkpoint) is its own revision.
        trust_remote_code: run the model repository's own Python code (``model.trust_remote_code``), needed by
            architectures transformers does not ship.
    """

    revision: str | None = None
    trust_remote_code: bool = False

    @classmethod
    def of(cls, model) -> ModelSource:
        """The options of a spec's ``model`` section (any object with ``revision`` and ``trust_remote_code``)."""
        return cls(revision=model.revision, trust_remote_code=bool(model.trust_remote_code))

    def revision_for(self, path: str) -> str | None:
        """The revision to ask for when loading ``path``: None for a local folder, else :attr:`revision`."""
        return None if os.path.isdir(os.path.expanduser(path)) else self.revision

    def hf_kwargs(self, path: str) -> dict:
        """Keyword arguments for ``AutoConfig/AutoTokenizer/AutoModel*.from_pretrained(path, ...)``:
        ``trust_remote_code`` always, ``revision`` for a hub id only (:meth:`revision_for`)."""
        kwargs: dict = {"trust_remote_code": self.trust_remote_code}
        revision = self.revision_for(path)
        if revision is not None:
            kwargs["revision"] = revision
        return kwargs
