"""Namespace / component / endpoint addresses such as `shoal.backend.generate`."""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True, slots=True)
class EndpointAddress:
    """One endpoint of one component in one namespace; every instance serving it shares it."""

    namespace: str
    component: str
    endpoint: str

    def __post_init__(self) -> None:
        for part in ("namespace", "component", "endpoint"):
            value = getattr(self, part)
            if not _NAME.match(value):
                raise ValueError(f"{part} {value!r} must be letters, digits, '_' or '-'")

    @classmethod
    def parse(cls, text: str | EndpointAddress) -> EndpointAddress:
        """Parse `namespace.component.endpoint`; an EndpointAddress is returned as is."""
        if isinstance(text, EndpointAddress):
            return text
        parts = text.split(".")
        if len(parts) != 3:
            raise ValueError(f"endpoint address {text!r} must be namespace.component.endpoint")
        return cls(*parts)

    @property
    def path(self) -> str:
        """The address as `namespace/component/endpoint`, the discovery key prefix."""
        return f"{self.namespace}/{self.component}/{self.endpoint}"

    def __str__(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"
