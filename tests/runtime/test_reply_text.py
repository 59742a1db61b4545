"""A reply's text as it streams: stop strings found across tokens, and the
end that could begin one held back until the reply ends."""

from semantic.runtime.text.reply_text import ReplyText


class Pieces:
    """A detokenizer whose tokens are the indices of ``pieces``."""

    def __init__(self, pieces: list[str]):
        self.pieces, self.last_segment = pieces, ""

    def add_token(self, token: int) -> None:
        self.last_segment = self.pieces[token]

    def finalize(self) -> None:
        self.last_segment = ""


def stream(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], ReplyText, bool]:
    reply, shown, hit = ReplyText(Pieces(pieces), stops), [], False
    for token in range(len(pieces)):
        reply.add(token)
        text, hit = reply.release(final=False)
        shown.append(text)
        if hit:
            return shown, reply, hit
    reply.finish()
    shown.append(reply.release(final=True)[0])
    return shown, reply, hit


def test_a_stop_string_across_tokens_ends_the_text_before_it():
    shown, reply, hit = stream(["Hello", " wor", "ld", " EN", "D more"], ("END",))
    assert hit and reply.stop == "END" and reply.text == "Hello world "
    assert shown == ["Hello", " wor", "ld", " ", ""]  # "EN" held back: it could begin "END"


def test_the_first_of_two_stop_strings_wins_and_a_held_back_end_shows_at_the_end():
    shown, reply, hit = stream(["ab", "cd", "ef"], ("ef", "cd"))
    assert hit and reply.stop == "cd" and "".join(shown) == reply.text == "ab"
    shown, reply, hit = stream(["one", " E"], ("END",))
    assert not hit and reply.stop is None and shown == ["one", " ", "E"]
