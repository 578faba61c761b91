"""SGLang's forward mode as the part clock reads it (`is_decode`, `is_extend`), without importing SGLang: tests of
the clock that run before a test world has set SGLang up for this CPU."""

from __future__ import annotations


class Mode:
    def __init__(self, decode: bool) -> None:
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode

    def is_extend(self) -> bool:
        return not self.decode
