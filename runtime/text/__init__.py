"""Text in and out: JSON that comes from outside, what a reply's text
must follow, what of it is shown, and how much of a prompt is already
cached, matched on text.

* ``json_reader``: the one bounded reader for JSON from outside (request
  bodies, archives, files on disk, a model's tool calls);
* ``grammar``: constrained decoding: a grammar a reply must follow,
  compiled and matched by llguidance;
* ``json_grammar``: JSON schemas as llguidance Lark;
* ``closing``: the tokens that finish what a grammar has begun;
* ``reply_text``: a reply's text as it streams, its stop strings found;
* ``prefix``: how much of an agent's stored cache a new prompt can keep.

Imports nothing else of the runtime. Every other room of the runtime may
import it, and so may the packages above; ``web`` only ``json_reader``.
"""
