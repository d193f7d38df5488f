"""Typed errors of the models package."""


class ModelLoadError(ValueError):
    """A model file is missing, unreadable, corrupt or describes something kvtier cannot run.

    The message always names the offending file and the problem.
    """

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, the template failed to render, or the chat cannot
    be rendered as asked; `param` names the request field at fault, when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedContentError(ChatTemplateError):
    """A message content part other than text (an image, audio)."""
