"""The answer checker's notation kinds, each tested over all its members (grpo.rewards.answer_text and
grpo.rewards.numbers module docs, docs/own_task.md): sign characters × currency prefixes, mixed numbers
(sign × whole × separator × fraction writing), LaTeX fraction macros (macro × argument form × sign × context), and
the non-members of each kind. Every member is read through every path that reads numbers: the answer after "####",
the last number of a text, the last number in \\boxed{}, the reference parser and the format rule (F3)."""

from __future__ import annotations

import itertools
import re
import sys
import unicodedata
from fractions import Fraction

import pytest

from grpo.rewards.answer_text import (CURRENCY_CODES, CURRENCY_SYMBOLS, FRACTION_MACROS, LATEX_CURRENCY, MINUS_SIGNS,
                                      PLUS_SIGNS, SPACE_CHARS)
from grpo.rewards.gsm8k import accuracy_reward, extract_answer, format_reward, parse_reference
from grpo.rewards.reasoning_gym import extract_final_answer

# Reasoning that meets the format rule's F4-F5 for any answer (34 non-whitespace characters, 5 numbers).
WORK = "She buys 3 packs of 4 pens, so 3 * 4 = 12 pens.\n"


def _expand(char_class: str) -> list[str]:
    """The characters of a regex class body made of single characters and ``a-b`` ranges."""
    out, i = [], 0
    while i < len(char_class):
        if i + 2 < len(char_class) and char_class[i + 1] == "-":
            out += [chr(c) for c in range(ord(char_class[i]), ord(char_class[i + 2]) + 1)]
            i += 3
        else:
            out.append(char_class[i])
            i += 1
    return out


SYMBOLS = _expand(CURRENCY_SYMBOLS)
PREFIXES = (SYMBOLS + ["US$", "C$", "A$", "HK$", "NZ$", "R$"] + list(CURRENCY_CODES) + ["Rs."]
            + list(LATEX_CURRENCY))
SIGNS = [(s, -1) for s in MINUS_SIGNS] + [(s, 1) for s in PLUS_SIGNS]
#: A few prefixes of each sort, for the tables that cross them with other dimensions.
SOME_PREFIXES = ["$", "€", "£", "¥", "₹", "US$", "USD", "Rs.", "\\$", "\\euro"]


def _value(text: str | None) -> Fraction | None:
    if text is None:
        return None
    num, _, den = text.partition("/")
    return Fraction(num) / Fraction(den or 1)


def _reads_as(written: str, expected: Fraction) -> None:
    """``written`` (one number) is ``expected`` on every path: after "####", as the last number, in \\boxed{}, as a
    reference; and the answer line "#### written" is well formatted."""
    for completion in (f"#### {written}", f"So it is {written}", f"\\boxed{{{written}}}", f"{written}\n#### {written}"):
        assert _value(extract_answer(completion)) == expected, (completion, extract_answer(completion), expected)
    assert _value(parse_reference(f"Work.\n#### {written}")) == expected, written
    assert format_reward(WORK + f"#### {written}") == 1.0, written
    assert accuracy_reward(f"#### {written}", str(expected)) == 1.0, written
    if expected != 0:
        assert accuracy_reward(f"#### {written}", str(-expected)) == 0.0, written


def test_currency_symbols_are_every_unicode_currency_symbol():
    """:data:`CURRENCY_SYMBOLS` is exactly Unicode's category Sc in the interpreter's Unicode database (14.0 for
    Python 3.11): a symbol added by a later Unicode version would show up here."""
    sc = {chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Sc"}
    assert set(SYMBOLS) == sc, sorted(sc ^ set(SYMBOLS))


# ---- kind: a sign before a currency prefix ------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("sign, factor", SIGNS, ids=[f"U+{ord(s):04X}" for s, _ in SIGNS])
def test_a_sign_before_any_currency_prefix_is_the_numbers(sign, factor, prefix):
    """Every sign character × every currency prefix × no space / a space after the prefix × three number shapes:
    the sign touching the prefix belongs to the number."""
    for gap, (number, value) in itertools.product(("", " "), (("5", 5), ("1,000", 1000), (".5", Fraction(1, 2)))):
        if prefix == "Rs" and gap == "" and number == ".5":
            value = 5  # "Rs.5" is Rs. 5: the abbreviation's dot
        _reads_as(f"{sign}{prefix}{gap}{number}", factor * Fraction(value))


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("sign, factor", SIGNS, ids=[f"U+{ord(s):04X}" for s, _ in SIGNS])
def test_a_sign_after_a_currency_prefix_is_the_numbers(sign, factor, prefix):
    for gap in ("", " "):
        _reads_as(f"{prefix}{gap}{sign}7", Fraction(7 * factor))


@pytest.mark.parametrize("prefix", PREFIXES)
def test_an_unsigned_currency_prefix_is_dropped(prefix):
    for gap in ("", " "):
        _reads_as(f"{prefix}{gap}12", Fraction(12))


@pytest.mark.parametrize("prefix", SOME_PREFIXES)
@pytest.mark.parametrize("sign", MINUS_SIGNS, ids=[f"U+{ord(s):04X}" for s in MINUS_SIGNS])
def test_a_sign_between_numbers_or_apart_from_the_prefix_is_no_sign(sign, prefix):
    """Non-members: a sign glued to a digit before it is subtraction ("10-$5"), a sign with a space before the prefix
    is no sign ("20 - $5"), as "10-5" and "- 5" are not -5."""
    assert extract_answer(f"#### 10{sign}{prefix}5") == "10"
    assert extract_answer(f"We pay 10{sign}{prefix}5") == "5"
    assert extract_answer(f"We pay 20 {sign} {prefix}5") == "5"
    assert extract_answer(f"x{sign}{prefix}5") == "5"


@pytest.mark.parametrize("sign, factor", SIGNS, ids=[f"U+{ord(s):04X}" for s, _ in SIGNS])
def test_every_sign_character_signs_a_plain_number_as_hyphen_does(sign, factor):
    _reads_as(f"{sign}3", Fraction(3 * factor))
    _reads_as(f"{sign}2.5", Fraction(5 * factor, 2))
    assert extract_answer(f"10 {sign}3") == str(-3 if factor < 0 else 3)
    assert extract_answer(f"10{sign}3") == "3"  # a range or a difference, never -3
    assert extract_answer(f"pages 3{sign}5") == "5"


def test_em_dash_is_punctuation_never_a_sign():
    assert extract_answer("#### \u20145") == "5"
    assert extract_answer("#### \u2014$5") == "5"


@pytest.mark.parametrize("sign, factor", SIGNS, ids=[f"U+{ord(s):04X}" for s, _ in SIGNS])
def test_reasoning_gym_answers_read_every_sign_character(sign, factor):
    """The reasoning-gym reward's extraction: a numeric answer after "####" or in <answer> tags, and the last-number
    fallback, read any sign character as "-"/"+"; a non-numeric answer is passed unchanged."""
    ascii_sign = "-" if factor < 0 else "+"
    assert extract_final_answer(f"so\n#### {sign}7") == f"{ascii_sign}7"
    assert extract_final_answer(f"<answer>{sign}7</answer>") == f"{ascii_sign}7"
    assert extract_final_answer(f"So 12 {sign}19 gives {sign}7.", "last_number") == ("-7" if factor < 0 else "7")
    assert extract_final_answer(f"#### a{sign}b") == f"a{sign}b"


# ---- kind: mixed numbers ------------------------------------------------------------------------------------------
#: (writing of the fraction 1/2, whether it may touch the whole number): a slash, the fraction and division slashes,
#: a vulgar fraction, every fraction macro in several argument forms.
FRACTION_WRITINGS = ([("1/2", False), ("1\u20442", False), ("1\u22152", False), ("½", True)]
                     + [(f"\\{m}{args}", True) for m in FRACTION_MACROS
                        for args in ("{1}{2}", "12", "1{2}", "{1}2", " {1} {2}")])
SEPARATORS = [" ", "\t", "   ", *SPACE_CHARS, "~", "\\ ", "\\;"]


@pytest.mark.parametrize("fraction, may_touch", FRACTION_WRITINGS, ids=[w for w, _ in FRACTION_WRITINGS])
@pytest.mark.parametrize("sign, factor", [("", 1), *SIGNS], ids=["none"] + [f"U+{ord(s):04X}" for s, _ in SIGNS])
def test_mixed_numbers_are_one_value(sign, factor, fraction, may_touch):
    """Every sign × two whole numbers × every separator (and none, where the fraction can touch the whole) × every
    writing of 1/2: the whole plus the fraction, signed as a whole."""
    separators = SEPARATORS + ([""] if may_touch else [])
    for whole, separator in itertools.product(("2", "1,000"), separators):
        written = f"{sign}{whole}{separator}{fraction}"
        _reads_as(written, factor * (int(whole.replace(",", "")) + Fraction(1, 2)))


@pytest.mark.parametrize("prefix", SOME_PREFIXES)
@pytest.mark.parametrize("sign, factor", SIGNS, ids=[f"U+{ord(s):04X}" for s, _ in SIGNS])
def test_mixed_numbers_with_a_signed_currency_prefix(sign, factor, prefix):
    _reads_as(f"{sign}{prefix}2 1/2", factor * Fraction(5, 2))
    _reads_as(f"{sign}{prefix}2\\frac{{1}}{{2}}", factor * Fraction(5, 2))


@pytest.mark.parametrize("text, expected", [
    ("#### 2 3/2", "2"),          # improper: 2 then 3/2
    ("So 2 3/2", "3/2"),
    ("#### 2 1/0", "2"),           # zero denominator
    ("#### 2 1/2.5", "2"),         # decimal part in the fraction
    ("So 2.5 1/2", "1/2"),         # decimal whole number
    ("#### 2 1/2/3", "2"),         # a fraction followed by another slash
    ("So 2-1/2", "1/2"),           # joined by a hyphen: 2 then 1/2
    ("So x2 1/2", "1/2"),          # whole number glued to a word
    ("#### 2\n1/2", "2"),          # a line break is no separator
])
def test_non_mixed_numbers(text, expected):
    assert extract_answer(text) == expected


# ---- kind: LaTeX fraction macros ----------------------------------------------------------------------------------
ARG_FORMS = [("{3}{4}", "3/4"), ("34", "3/4"), ("3{4}", "3/4"), ("{3}4", "3/4"), (" 3 4", "3/4"),
             (" {3} {4}", "3/4"), ("{ 3 }{ 4 }", "3/4"), ("{12}{5}", "12/5"), ("{1,000}{3}", "1000/3"),
             ("{-3}{4}", "-3/4"), ("{\u22123}{4}", "-3/4")]


@pytest.mark.parametrize("args, value", ARG_FORMS, ids=[a for a, _ in ARG_FORMS])
@pytest.mark.parametrize("macro", FRACTION_MACROS)
def test_every_fraction_macro_in_every_argument_form(macro, args, value):
    """Every macro × every argument form (braced, single digits, mixed, spaced) × a sign before it (none, each
    sign character), on every reading path."""
    expected = Fraction(value)
    for sign, factor in [("", 1), *SIGNS] if value[0] != "-" else [("", 1)]:  # a double sign is no member
        _reads_as(f"{sign}\\{macro}{args}", factor * expected)
    if macro == "cfrac":
        _reads_as(f"\\cfrac[l]{args}", expected)


@pytest.mark.parametrize("macro", FRACTION_MACROS)
def test_a_digit_after_a_single_digit_fraction_is_a_new_number(macro):
    """TeX reads \\frac123 as 1/2 followed by 3 (each argument is one token): not 1/23."""
    assert extract_answer(f"\\boxed{{\\{macro}123}}") == "3"
    assert extract_answer(f"#### \\{macro}123") == "1/2"
    assert extract_answer(f"#### \\{macro}{{1}}{{2}}3") == "1/2"


@pytest.mark.parametrize("text", ["\\fracx{1}{2}", "\\frac{1}", "\\frac{a}{b}", "\\frac{1}{2"])
def test_malformed_fraction_macros_are_no_fractions(text):
    assert extract_answer(f"#### {text}") in (None, "1", "2")
    assert re.search(r"/", extract_answer(f"#### {text}") or "") is None
