"""Text the commands print: a generated sample with control bytes reaches the terminal escaped."""

from adaptdist.cli.train import print_sample
from adaptdist.console import printable_text, report_console


def test_printable_text_escapes_controls_and_keeps_newlines():
    assert printable_text("a\x1b[2Jb\nc\td") == "a\\x1b[2Jb\nc\td"
    assert printable_text("\x07\r\x08\x00\x7f\x85") == "\\x07\\r\\x08\\x00\\x7f\\x85"  # C0, DEL, C1
    assert printable_text("x\u202ey\u2028z") == "x\\u202ey\\u2028z"  # a bidi override, a line separator
    assert printable_text("héllo \ufffd 'q\" \\ ok") == "héllo \ufffd 'q\" \\ ok"  # printable text unchanged


def test_train_prints_the_sample_escaped(capsys):
    # what builtin:gpt's sample() returns after a short run: bytes decoded with errors="replace", controls included
    text = bytes([100, 101, 102, 32, 27, 91, 51, 49, 109, 7, 10, 13, 8, 255]).decode("utf-8", errors="replace")
    print_sample(report_console(), text)
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\r\x08"), repr(out)
    assert "def \\x1b[31m\\x07\n\\r\\x08\ufffd" in out and "sample" in out
