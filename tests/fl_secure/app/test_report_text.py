"""Text a client chose (a tensor name in a refused upload) stays text in every report format."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fl_secure import serde
from fl_secure.app.report.render_markdown import md_text
from fl_secure.errors import ProtocolError
from fl_secure.messages import TensorSpec

#: A tensor name a malicious client sends: a remote image (a tracking pixel), raw HTML, a
#: table break, a line break that would start a heading of its own.
PAYLOAD = "![](https://attacker.example/pixel.png)<img src=x onerror=alert(1)>|col\n# Owned [x](y)"


def test_a_client_tensor_name_is_quoted_cut_and_on_one_line_in_the_error() -> None:
    reader = serde.TensorStreamReader([TensorSpec("w", (2,), np.dtype("<f4"))], max_bytes=1000)
    name = PAYLOAD + "A" * 5000
    header = serde.tensor_header(name, np.zeros(2, np.float32))
    with pytest.raises(ProtocolError) as caught:
        reader.add_header(header)
    message = str(caught.value)
    shown = repr(name[: serde.QUOTED_NAME_CHARS])
    assert message == (
        f"tensor #0 is {shown} (first {serde.QUOTED_NAME_CHARS} of {len(name)} characters), "
        "expected 'w'"
    )
    assert "\n" not in message and len(message) < 200
    # a short name is quoted whole
    assert serde.quoted_name("v") == "'v'"


def test_markdown_text_carries_no_markup() -> None:
    text = md_text(PAYLOAD)
    assert text == (
        "!\\[\\](https://attacker.example/pixel.png)&lt;img src=x onerror=alert(1)&gt;\\|col "
        "# Owned \\[x\\](y)"
    )
    # no image or link syntax, no HTML tag, no unescaped pipe is left
    assert "![" not in text and "<" not in text and not re.search(r"(?<!\\)\|", text)
    # emphasis, code, strikethrough; an underscore inside a word is left alone
    assert md_text("*a* _b_ `c` ~d~ tar_at_far_1e-2") == (
        "\\*a\\* \\_b\\_ \\`c\\` \\~d\\~ tar_at_far_1e-2"
    )
    # what would open a block at the start of a line
    assert [md_text(x) for x in ("# h", "- a", "1. x", "0.5", "3 rounds")] == [
        "\\# h",
        "\\- a",
        "1\\. x",
        "0.5",
        "3 rounds",
    ]
