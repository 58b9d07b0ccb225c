#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gen_corpus.py: writes libfsdp's default training corpus (data/corpus.txt).

The text is made here, from nothing: a small seeded probabilistic grammar of English-like
sentences about villagers, animals and places. Nothing is copied from any other text, so the
output belongs to the project.

The grammar is deliberately regular (a few hundred words, a few dozen sentence shapes, agreement
between subjects, verbs and pronouns, paragraphs that keep to one character), so that a small
byte-level GPT learns spelling within seconds and then grammar: its loss falls visibly within
about a minute of training. It is also varied enough (relative clauses, questions, dialogue,
lists, time and place phrases) that the model cannot simply memorise it.

Usage: python3 data/gen_corpus.py [--seed N] [--bytes N] [-o data/corpus.txt]
Standard library only. The same seed and size give the same bytes (random.Random is specified
to be reproducible for a given seed across Python 3 releases).
"""

import argparse
import random
import sys

# ---- the lexicon -------------------------------------------------------------------------------

# (singular, plural, pronoun) for people and animals; pronoun is the subject pronoun.
PEOPLE = [
    ("miller", "millers", "he"), ("baker", "bakers", "she"), ("weaver", "weavers", "she"),
    ("shepherd", "shepherds", "he"), ("smith", "smiths", "he"), ("fisherman", "fishermen", "he"),
    ("gardener", "gardeners", "she"), ("teacher", "teachers", "she"), ("sailor", "sailors", "he"),
    ("potter", "potters", "she"), ("carpenter", "carpenters", "he"), ("farmer", "farmers", "she"),
    ("traveller", "travellers", "he"), ("child", "children", "she"), ("king", "kings", "he"),
    ("queen", "queens", "she"), ("doctor", "doctors", "he"), ("painter", "painters", "she"),
]
ANIMALS = [
    ("fox", "foxes"), ("crow", "crows"), ("horse", "horses"), ("goat", "goats"),
    ("rabbit", "rabbits"), ("owl", "owls"), ("dog", "dogs"), ("cat", "cats"), ("bear", "bears"),
    ("mouse", "mice"), ("duck", "ducks"), ("wolf", "wolves"), ("deer", "deer"),
    ("hen", "hens"), ("badger", "badgers"),
]
NAMES = [
    ("Anna", "she"), ("Tom", "he"), ("Mira", "she"), ("Oskar", "he"), ("Lena", "she"),
    ("Pavel", "he"), ("Ida", "she"), ("Bruno", "he"), ("Nora", "she"), ("Emil", "he"),
    ("Greta", "she"), ("Felix", "he"), ("Rosa", "she"), ("Karl", "he"),
]
THINGS = [
    ("basket", "baskets"), ("lantern", "lanterns"), ("loaf", "loaves"), ("letter", "letters"),
    ("key", "keys"), ("boat", "boats"), ("coat", "coats"), ("cart", "carts"), ("bell", "bells"),
    ("apple", "apples"), ("stone", "stones"), ("rope", "ropes"), ("map", "maps"),
    ("cup", "cups"), ("book", "books"), ("box", "boxes"), ("wheel", "wheels"),
    ("candle", "candles"), ("blanket", "blankets"), ("feather", "feathers"),
]
PLACES = [
    "the mill", "the river", "the market", "the old bridge", "the forest", "the harbour",
    "the hill", "the meadow", "the village", "the well", "the orchard", "the tower",
    "the garden", "the school", "the barn", "the lake", "the road to the city", "the kitchen",
]
ADJ = [
    "old", "young", "small", "tall", "quiet", "clever", "tired", "brave", "kind", "hungry",
    "happy", "careful", "lazy", "curious", "gentle", "proud", "poor", "rich",
]
THING_ADJ = [
    "heavy", "red", "broken", "new", "wooden", "round", "empty", "warm", "green", "little",
    "bright", "blue", "strange", "golden", "wet", "long",
]
COLOURS = ["red", "blue", "green", "grey", "white", "black", "yellow", "brown"]
TIMES = [
    "in the morning", "at noon", "in the evening", "at night", "before dawn", "after supper",
    "on Monday", "on the first day of spring", "in the winter", "every Sunday",
    "one cold morning", "late in the autumn", "during the storm", "after the rain",
]
WEATHER = [
    "The sky was grey and the wind was cold.", "The sun was warm on the fields.",
    "Rain fell on the roofs all day.", "Snow lay on the hills.", "A thick fog came up from the river.",
    "The air smelled of bread and smoke.", "The night was clear and full of stars.",
    "It was the hottest day of the summer.",
]

# Verbs: (base, third person singular, past). Transitive verbs take a thing as object.
TRANS = [
    ("carry", "carries", "carried"), ("find", "finds", "found"), ("lose", "loses", "lost"),
    ("mend", "mends", "mended"), ("sell", "sells", "sold"), ("buy", "buys", "bought"),
    ("paint", "paints", "painted"), ("hide", "hides", "hid"), ("open", "opens", "opened"),
    ("clean", "cleans", "cleaned"), ("drop", "drops", "dropped"), ("want", "wants", "wanted"),
    ("make", "makes", "made"), ("bring", "brings", "brought"), ("keep", "keeps", "kept"),
    ("give away", "gives away", "gave away"), ("count", "counts", "counted"),
]
# Verbs that take a person or animal as object.
SOCIAL = [
    ("meet", "meets", "met"), ("help", "helps", "helped"), ("follow", "follows", "followed"),
    ("call", "calls", "called"), ("thank", "thanks", "thanked"), ("watch", "watches", "watched"),
    ("visit", "visits", "visited"), ("teach", "teaches", "taught"), ("feed", "feeds", "fed"),
    ("wait for", "waits for", "waited for"), ("talk to", "talks to", "talked to"),
]
# Intransitive verbs of motion that take a place.
MOTION = [
    ("walk to", "walks to", "walked to"), ("run to", "runs to", "ran to"),
    ("go to", "goes to", "went to"), ("return to", "returns to", "returned to"),
    ("hurry to", "hurries to", "hurried to"), ("come back from", "comes back from", "came back from"),
    ("sit by", "sits by", "sat by"), ("sleep near", "sleeps near", "slept near"),
]
INTRANS = [
    ("laugh", "laughs", "laughed"), ("sing", "sings", "sang"), ("wait", "waits", "waited"),
    ("rest", "rests", "rested"), ("work", "works", "worked"), ("cry", "cries", "cried"),
    ("smile", "smiles", "smiled"), ("listen", "listens", "listened"),
]
NAME_SET = {n for n, _ in NAMES}
FEELINGS = ["glad", "afraid", "angry", "sad", "surprised", "proud", "worried", "calm", "sorry"]
SAY = ["said", "answered", "whispered", "called", "replied", "shouted"]
CONNECT = ["Then", "Later", "After that", "Soon", "At last", "Meanwhile", "Suddenly", "So"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve"]


class Entity:
    """One character of a paragraph: how to name it the first time and afterwards."""

    def __init__(self, first, short, pronoun, obj, poss, plural):
        self.first, self.short, self.pronoun = first, short, pronoun
        self.obj, self.poss, self.plural = obj, poss, plural
        self.mentioned = False

    def name(self):
        """The first mention is indefinite ("a tired fox"), later ones definite ("the fox")."""
        if self.mentioned:
            return self.short
        self.mentioned = True
        return self.first


PRON = {"he": ("he", "him", "his"), "she": ("she", "her", "her"), "it": ("it", "it", "its"),
        "they": ("they", "them", "their")}


def article(word):
    return "an" if word[0] in "aeiou" else "a"


class Gen:
    def __init__(self, seed):
        self.r = random.Random(seed)

    def pick(self, seq):
        return self.r.choice(seq)

    def chance(self, p):
        return self.r.random() < p

    # ---- noun phrases ----

    def character(self):
        k = self.r.random()
        if k < 0.35:
            name, pron = self.pick(NAMES)
            p = PRON[pron]
            return Entity(name, name, p[0], p[1], p[2], False)
        if k < 0.7:
            sg, _, pron = self.pick(PEOPLE)
            adj = self.pick(ADJ)
            p = PRON[pron]
            return Entity(f"{article(adj)} {adj} {sg}", f"the {sg}", p[0], p[1], p[2], False)
        if k < 0.9:
            sg, _ = self.pick(ANIMALS)
            adj = self.pick(ADJ)
            p = PRON["it"]
            return Entity(f"{article(adj)} {adj} {sg}", f"the {sg}", p[0], p[1], p[2], False)
        n = self.pick(NUMBERS)
        _, pl = self.pick(ANIMALS + [(a, b) for a, b, _ in PEOPLE])
        p = PRON["they"]
        return Entity(f"{n} {pl}", f"the {pl}", p[0], p[1], p[2], True)

    def thing(self, definite=False):
        sg, pl = self.pick(THINGS)
        if self.chance(0.25):
            return f"{self.pick(NUMBERS)} {self.pick(THING_ADJ)} {pl}" if not definite else f"the {pl}"
        adj = self.pick(THING_ADJ) if self.chance(0.6) else ""
        words = f"{adj} {sg}".strip()
        if definite:
            return f"the {words}"
        return f"{article(words)} {words}"

    def other(self):
        """Another person or animal, mentioned once."""
        if self.chance(0.4):
            return self.pick(NAMES)[0]
        sg = self.pick(PEOPLE)[0] if self.chance(0.6) else self.pick(ANIMALS)[0]
        det = self.pick(["the", "a", "an old", "a young", "the other"])
        if det in ("a",) and sg[0] in "aeiou":
            det = "an"
        return f"{det} {sg}"

    # ---- verb phrases (subject agreement by tense) ----

    def verb(self, v, tense, plural):
        base, third, past = v
        if tense == "past":
            return past
        return base if plural else third

    def predicate(self, e, tense):
        k = self.r.random()
        if k < 0.3:
            s = f"{self.verb(self.pick(TRANS), tense, e.plural)} {self.thing()}"
            if self.chance(0.3):
                s += f" for {self.other()}"
        elif k < 0.55:
            s = f"{self.verb(self.pick(SOCIAL), tense, e.plural)} {self.other()}"
        elif k < 0.8:
            s = f"{self.verb(self.pick(MOTION), tense, e.plural)} {self.pick(PLACES)}"
        else:
            s = self.verb(self.pick(INTRANS), tense, e.plural)
        if self.chance(0.3):
            s += f" {self.pick(TIMES)}"
        return s

    def be(self, e, tense):
        if tense == "past":
            return "were" if e.plural else "was"
        return "are" if e.plural else "is"

    # ---- sentences ----

    def subject(self, e):
        """The full name on first mention, later the pronoun or the short name."""
        if e.mentioned and self.chance(0.6):
            return e.pronoun
        return e.name()

    def sentence(self, e, tense):
        k = self.r.random()
        subj = self.subject(e)
        if k < 0.25:
            s = f"{subj} {self.predicate(e, tense)}"
        elif k < 0.35:
            s = f"{subj} {self.predicate(e, tense)} and {self.predicate(e, tense)}"
        elif k < 0.45:
            s = f"{subj} {self.be(e, tense)} {self.pick(FEELINGS)} because {self.reason(e, tense)}"
        elif k < 0.53:
            thing = self.thing()
            rel = self.verb(self.pick(TRANS), "past", False)
            s = f"{subj} {self.verb(self.pick(TRANS), tense, e.plural)} {thing} that {self.other()} had {self.participle(rel)}"
        elif k < 0.61:
            place = self.pick(PLACES)
            s = f"{self.pick(TIMES).capitalize()}, {subj} {self.verb(self.pick(MOTION), tense, e.plural)} {place}"
            s = s[0].upper() + s[1:]
            return s + "."
        elif k < 0.69:
            s = f"When {subj} {self.predicate(e, tense)}, {self.other()} {self.verb(self.pick(INTRANS), tense, False)}"
        elif k < 0.76:
            items = [self.thing() for _ in range(self.r.randint(2, 4))]
            lst = ", ".join(items[:-1]) + " and " + items[-1]
            s = f"{subj} {self.verb(('have', 'has', 'had'), tense, e.plural)} {lst}"
        elif k < 0.86:
            return self.dialogue(e, tense)
        elif k < 0.92:
            return self.question(e, tense)
        else:
            col = self.pick(COLOURS)
            s = f"{subj} {self.verb(('see', 'sees', 'saw'), tense, e.plural)} a {col} {self.pick(ANIMALS)[0]} near {self.pick(PLACES)}"
        s = s[0].upper() + s[1:]
        return s + "."

    def participle(self, past):
        irregular = {"found": "found", "lost": "lost", "sold": "sold", "bought": "bought",
                     "hid": "hidden", "made": "made", "brought": "brought", "kept": "kept",
                     "gave away": "given away"}
        return irregular.get(past, past)

    def reason(self, e, tense):
        k = self.r.random()
        pron = e.pronoun
        if k < 0.4:
            return f"{pron} {self.verb(('have', 'has', 'had'), tense, e.plural)} lost {e.poss} {self.pick(THINGS)[0]}"
        if k < 0.7:
            return f"{self.other()} {self.verb(self.pick(SOCIAL), tense, False)} {e.obj}"
        return f"the {self.pick(THINGS)[0]} {'was' if tense == 'past' else 'is'} {self.pick(THING_ADJ)}"

    def dialogue(self, e, tense):
        k = self.r.random()
        if k < 0.35:
            line = f"I will {self.pick(TRANS)[0]} {self.thing(definite=True)} {self.pick(TIMES)}"
        elif k < 0.6:
            line = f"Have you seen my {self.pick(THINGS)[0]}?"
        elif k < 0.8:
            line = f"Let us go to {self.pick(PLACES)}"
        else:
            line = f"The {self.pick(THINGS)[0]} is {self.pick(THING_ADJ)} and {self.pick(THING_ADJ)}"
        if not line.endswith("?"):
            line += self.pick([".", "!", "."]) if self.chance(0.7) else ","
            if line.endswith("."):
                line = line[:-1] + ","
        who = self.subject(e)
        verb = "asked" if line.endswith("?") else self.pick(SAY)
        # "said the fox" but "she said": a pronoun goes before the verb.
        tail = f"{who} {verb}" if who in PRON else f"{verb} {who}"
        return f'"{line[0].upper()}{line[1:]}" {tail}.'

    def question(self, e, tense):
        who = e.short if e.mentioned else e.name()
        aux = ("Did" if tense == "past" else ("Do" if e.plural else "Does"))
        base = self.pick(TRANS)[0]
        answer = "Nobody knew." if tense == "past" else "Nobody knows."
        return f"{aux} {who} {base} {self.thing()}? {answer}"

    def paragraph(self):
        e = self.character()
        tense = "past" if self.chance(0.8) else "present"
        out = []
        if self.chance(0.3):
            out.append(self.pick(WEATHER))
        n = self.r.randint(3, 7)
        for i in range(n):
            s = self.sentence(e, tense)
            first = s.split(" ", 1)[0].rstrip(",")
            if i > 0 and self.chance(0.25) and first not in ("Did", "Do", "Does") \
                    and not s.startswith('"'):
                if first not in NAME_SET:
                    s = s[0].lower() + s[1:]
                s = f"{self.pick(CONNECT)} {s}"
            out.append(s)
        return " ".join(out)



def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=20240520)
    ap.add_argument("--bytes", type=int, default=300_000, help="stop after this many bytes")
    ap.add_argument("-o", "--output", default="-")
    args = ap.parse_args()
    g = Gen(args.seed)
    parts, size = [], 0
    while size < args.bytes:
        p = g.paragraph() + "\n\n"
        parts.append(p)
        size += len(p)
    text = "".join(parts)
    text.encode("ascii")  # the corpus is plain ASCII by construction
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="ascii", newline="\n") as f:
            f.write(text)


if __name__ == "__main__":
    main()
