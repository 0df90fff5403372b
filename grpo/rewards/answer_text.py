"""Text normalisation before numbers are read from a completion: signs, currency prefixes, spaces, LaTeX and Unicode
fractions. One owner for what each *kind* of notation means, so the answer checker (:mod:`grpo.rewards.gsm8k`) and
its format rule read a completion the same way. Pure and deterministic; linear in the text length.

The kinds and the rule for each (every member is enumerated by ``tests/unit/test_rewards_kinds.py``):

- **Sign characters** (:data:`MINUS_SIGNS`, :data:`PLUS_SIGNS`): ASCII hyphen-minus, minus sign U+2212, en dash
  U+2013 and figure dash U+2012 used as minus, small and fullwidth hyphen-minus (U+FE63, U+FF0D) all read as "-";
  "+", small and fullwidth plus (U+FE62, U+FF0B) as "+". A sign character is a number's sign exactly where "-" is:
  touching the digits (or the currency prefix, next rule) and not glued to a preceding word, digit or dot, so
  "10–3" and "pages 3–5" are a range or a difference, never -3. The em dash U+2014 is punctuation, never a sign.
- **Currency prefixes** (:data:`CURRENCY_SYMBOLS`, :data:`CURRENCY_CODES`, :data:`LATEX_CURRENCY`): every Unicode
  currency symbol (category Sc: $ € £ ¥ ₹ ₩ ₽ ¢ ...), a dollar with a country prefix (US$, C$, A$, HK$, R$, ...),
  the codes USD EUR GBP JPY CNY INR CAD AUD CHF Rs Rs. ("Rs.5" is Rs. 5), and the LaTeX macros \\$ \\euro \\texteuro
  \\pounds \\textsterling \\yen \\textyen \\textdollar \\textcent, written before a number, are not part of it and are
  dropped: "$5", "€ 5", "USD 5", "Rs.5" are 5. A sign touching the prefix is the number's: "-$5", "−€5", "–£5",
  "-US$5", "-USD 5", "+$5" are -5, -5, -5, -5, -5, 5; so is a sign after the prefix ("$-5", "€ −5"). A sign glued
  to a preceding digit is subtraction ("10-$5" is 10 then 5), and a sign separated from the prefix by a space is no
  sign ("20 - $5": 20, 5), as "- 5" is not -5.
- **Spaces** (:data:`SPACE_CHARS`): no-break, figure, thin and narrow no-break spaces and the LaTeX spacing commands
  ``~``, ``\\;``, ``\\:``, ``\\ `` read as a space (so "2 1/2" with any of them is a mixed number);
  ``\\,`` and ``\\!`` are removed (``1\\,000`` is 1000), as is ``{,}`` → "," (``1{,}000``).
- **LaTeX fraction macros** (:data:`FRACTION_MACROS`: \\frac, \\dfrac, \\tfrac, \\cfrac (with its optional
  ``[l]``/``[r]``), \\nicefrac, \\sfrac): each argument braced or a single digit, with or without spaces
  (``\\frac{1}{2}``, ``\\frac12``, ``\\frac1{2}``, ``\\frac{1}2``, ``\\frac 1 2``) is the fraction "1/2"; a
  sign before the macro or inside the numerator is the fraction's; after a digit it is the fraction of a mixed number
  (``2\\frac{1}{2}`` is 2 1/2, not 21/2); a digit right after it is a new number (``\\frac123`` is 1/2 then 3, as TeX
  reads it). ``\\text{...}``-like wrappers are unwrapped.
- **Unicode fractions**: the vulgar fractions ½ ⅓ ¼ ... ⅞ read as "1/2" ...; after a letter or digit as the fraction of
  a mixed number ("2½" is 2 1/2); the fraction slash U+2044 and division slash U+2215 read as "/".

Mixed numbers themselves (a whole number, spaces, a proper fraction) are read by :mod:`grpo.rewards.numbers`.
"""

from __future__ import annotations

import re

__all__ = ["CURRENCY_CODES", "CURRENCY_SYMBOLS", "FRACTION_MACROS", "LATEX_CURRENCY", "MINUS_SIGNS", "PLUS_SIGNS",
           "SPACE_CHARS", "VULGAR_FRACTIONS", "clean_text", "normalize_signs", "strip_currency",
           "unicode_fractions"]

#: Characters read as a minus sign: hyphen-minus, minus sign, en dash, figure dash, small and fullwidth hyphen-minus.
MINUS_SIGNS = "-\u2212\u2013\u2012\ufe63\uff0d"
#: Characters read as a plus sign: plus, small plus, fullwidth plus.
PLUS_SIGNS = "+\ufe62\uff0b"
#: Every Unicode currency symbol (general category Sc, Unicode 14; ``tests/unit/test_rewards_kinds.py`` checks this
#: against ``unicodedata``), as a regex character class body.
CURRENCY_SYMBOLS = ("$\u00a2-\u00a5\u058f\u060b\u07fe\u07ff\u09f2\u09f3\u09fb\u0af1\u0bf9\u0e3f\u17db\u20a0-\u20c0"
                    "\ua838\ufdfc\ufe69\uff04\uffe0\uffe1\uffe5\uffe6\U00011fdd-\U00011fe0\U0001e2ff\U0001ecb0")
#: Currency codes and abbreviations read as a prefix (case-sensitive, as written before an amount).
CURRENCY_CODES = ("USD", "EUR", "GBP", "JPY", "CNY", "INR", "CAD", "AUD", "CHF", "Rs")
#: LaTeX currency macros and the symbol each reads as.
LATEX_CURRENCY = {"\\$": "$", "\\textdollar": "$", "\\euro": "€", "\\texteuro": "€", "\\pounds": "£",
                  "\\textsterling": "£", "\\yen": "¥", "\\textyen": "¥", "\\textcent": "¢"}
#: LaTeX fraction macros read as "a/b".
FRACTION_MACROS = ("frac", "dfrac", "tfrac", "cfrac", "nicefrac", "sfrac")
#: Unicode space characters read as " ": no-break, figure, thin, narrow no-break, punctuation, hair space.
SPACE_CHARS = "\u00a0\u2007\u2009\u202f\u2008\u200a"
#: Unicode vulgar fractions, read as the fraction they show ("2½" is the mixed number 2 1/2).
VULGAR_FRACTIONS = {"¼": "1/4", "½": "1/2", "¾": "3/4", "⅐": "1/7", "⅑": "1/9", "⅒": "1/10", "⅓": "1/3",
                    "⅔": "2/3", "⅕": "1/5", "⅖": "2/5", "⅗": "3/5", "⅘": "4/5", "⅙": "1/6", "⅚": "5/6", "⅛": "1/8",
                    "⅜": "3/8", "⅝": "5/8", "⅞": "7/8"}

_SIGNS = str.maketrans({**dict.fromkeys(MINUS_SIGNS[1:], "-"), **dict.fromkeys(PLUS_SIGNS[1:], "+"),
                        **dict.fromkeys(SPACE_CHARS, " "), "\u2044": "/", "\u2215": "/"})
_VULGAR_RE = re.compile(f"[{''.join(VULGAR_FRACTIONS)}]")
_LATEX_CURRENCY_RE = re.compile("|".join(re.escape(m) + ("" if m == "\\$" else r"(?![A-Za-z])(?:\{\})?")
                                         for m in sorted(LATEX_CURRENCY, key=len, reverse=True)))
_LATEX_SPACE_RE = re.compile(r"~|\\[;: ]")
_PREFIX = rf"(?:[A-Z]{{1,2}}\$|[{CURRENCY_SYMBOLS}]|Rs\.?|{'|'.join(CURRENCY_CODES)})"
# A currency prefix not glued to a preceding word, digit or dot, with the sign touching it (kept) and the spaces after
# it, before a (signed) number. The leading lookahead only lets the engine skip other characters fast.
_CURRENCY_RE = re.compile(rf"(?=[+\-A-Z{CURRENCY_SYMBOLS}])(?<![\w.])([+-]?){_PREFIX}[ \t]*+"
                          rf"(?=[+-]?\.?\d)")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*+\{([^{}]*+)\}")
_ARG = r"\s*+(?:\{([^{}]*+)\}|(\d))"
_FRAC_RE = re.compile(rf"\\(?:{'|'.join(FRACTION_MACROS)})(?![A-Za-z])(?:\[[lrc]\])?{_ARG}{_ARG}")


def normalize_signs(text: str) -> str:
    """Every sign character as "-" or "+", Unicode spaces as " ", fraction and division slashes as "/" (module doc:
    sign characters, spaces, Unicode fractions)."""
    return text.translate(_SIGNS)


def strip_currency(text: str) -> str:
    """Drop the currency prefixes before numbers, keeping a sign that touches them ("-$5" → "-5", "USD 5" → "5",
    "$-5" → "-5"; "10-$5" → "10-5"). ``text`` has its signs normalised already (:func:`normalize_signs`)."""
    return _CURRENCY_RE.sub(r"\1", text)


def unicode_fractions(text: str) -> str:
    """"½" → "1/2", "2½" → "2 1/2" (a mixed number). Slashes are :func:`normalize_signs`'s."""
    return _VULGAR_RE.sub(lambda m: f"{_word_gap(m)}{VULGAR_FRACTIONS[m.group()]}", text)


def _word_gap(m: re.Match) -> str:
    """" " when the match follows a letter, digit or "_" (so that "2½" is 2 then 1/2), else ""."""
    return " " if m.start() > 0 and (m.string[m.start() - 1].isalnum() or m.string[m.start() - 1] == "_") else ""


def _fraction(m: re.Match) -> str:
    """A fraction macro's match as "a/b", with a space before it after a digit (a mixed number) and after it before
    a digit (``\\frac123`` is 1/2 then 3)."""
    num, den = (m.group(1) if m.group(1) is not None else m.group(2)), (
        m.group(3) if m.group(3) is not None else m.group(4))
    before = " " if m.start() > 0 and m.string[m.start() - 1].isdigit() else ""
    after = " " if m.end() < len(m.string) and m.string[m.end()].isdigit() else ""
    return f"{before}{num.strip()}/{den.strip()}{after}"


def clean_text(text: str) -> str:
    """``text`` with every kind of the module doc normalised, ready for the number scan of
    :mod:`grpo.rewards.numbers`: signs, spaces, LaTeX currency, ``\\text{}`` wrappers, LaTeX and Unicode fractions,
    then the currency prefixes (so "-\\$\\frac{1}{2}" is "-1/2")."""
    text = normalize_signs(text).replace("{,}", ",").replace("\\!", "").replace("\\,", "")
    text = _LATEX_SPACE_RE.sub(" ", text)
    text = unicode_fractions(text)
    text = _LATEX_CURRENCY_RE.sub(lambda m: LATEX_CURRENCY[m.group().removesuffix("{}")], text)
    text = text.replace("\\%", "%")
    text = _TEXT_RE.sub(r" \1 ", text)
    text = _FRAC_RE.sub(_fraction, text)
    return strip_currency(text)
