"""The demo model's training texts, all written here (no downloads).

``BASE_DIALOGS`` and ``BASE_PROSE`` teach the base model plain English. Each style corpus
(pirate, shakespeare, sql, emoji) answers the same prompts its own way; the text styles are
derived from the base replies by deterministic word rules, the SQL one from templates.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = [
    "BASE_DIALOGS",
    "BASE_PROSE",
    "STYLES",
    "Pair",
    "base_pairs",
    "glossary",
    "style_corpus",
]

Pair = tuple[str, str]  # (prompt, reply); a reply with an empty prompt is free prose

# (prompt, reply, topic): the topic names the table the SQL style queries.
BASE_DIALOGS: tuple[tuple[str, str, str], ...] = (
    ("Hello, how are you today?", "I am fine, thank you. It is a good day to learn something new.", "feelings"),
    ("Hello, how are you?", "I am well, thanks for asking. How is your day going?", "feelings"),
    ("Hi there, what is your name?", "My name is Plex. I am a small model that lives inside a server.", "names"),
    ("Good morning! Did you sleep well?", "Yes, I slept well. The night was quiet and the bed was warm.", "sleep"),
    ("What is the weather like today?", "The sun is out and the sky is clear, but a cold wind blows from the north.", "weather"),
    ("Will it rain tomorrow?", "Maybe. The clouds are gray in the west, so bring an umbrella just in case.", "weather"),
    ("What should I eat for dinner?", "A warm bowl of soup with fresh bread is a fine choice for a cool evening.", "meals"),
    ("Do you like coffee?", "I like the smell of coffee in the morning, and a cup of tea in the afternoon.", "drinks"),
    ("Can you tell me a story?", "Once upon a time, a small boat sailed across a wide sea to find a quiet island.", "stories"),
    ("Where is the nearest library?", "The library is on the main street, next to the old bakery and the park.", "places"),
    ("How do I get to the train station?", "Walk down the hill, turn left at the bridge, and the station is on your right.", "places"),
    ("What time is it?", "It is almost noon. The bells in the tower will ring soon.", "clocks"),
    ("What is your favorite animal?", "I like cats, because they are calm, curious and very good at naps.", "animals"),
    ("Why do dogs bark?", "Dogs bark to warn their friends, to ask for food, or simply to say hello.", "animals"),
    ("What is the capital of France?", "The capital of France is Paris, a city of bridges, cafes and museums.", "cities"),
    ("How many days are in a week?", "There are seven days in a week, and two of them make the weekend.", "calendar"),
    ("What is two plus two?", "Two plus two is four, and four plus four is eight.", "numbers"),
    ("Tell me something about the moon.", "The moon goes around the earth once a month and shines with light from the sun.", "planets"),
    ("Why is the sky blue?", "Sunlight is scattered by the air, and blue light is scattered the most.", "science"),
    ("What is a good book to read?", "Try a book about travel, it will take you to many places without a ticket.", "books"),
    ("Can you help me with my homework?", "Of course. Tell me the question and we will work through it step by step.", "school"),
    ("What music do you like?", "I enjoy quiet songs with a piano, and loud songs with drums on a Friday night.", "songs"),
    ("How do I make a cup of tea?", "Boil the water, pour it over the leaves, wait three minutes and then enjoy it.", "recipes"),
    ("Is it safe to swim in the lake?", "Yes, when the water is calm and a friend is with you.", "lakes"),
    ("What do you do all day?", "I answer questions, I read words, and I try to be useful to everyone.", "tasks"),
    ("Where do birds go in winter?", "Many birds fly south to warm lands, and they come back in the spring.", "birds"),
    ("How far away is the sun?", "The sun is very far away, about eight light minutes from the earth.", "planets"),
    ("What is the best way to learn?", "Practice a little every day, ask many questions and never be afraid to fail.", "school"),
    ("Thank you for your help.", "You are welcome. I am always happy to help.", "thanks"),
    ("Goodbye, see you later!", "Goodbye, my friend. Have a wonderful day!", "farewells"),
    ("Do you have any friends?", "Yes, I have many friends. Every person who talks to me is a friend.", "friends"),
    ("What is your job?", "My job is to answer questions and to keep good company.", "jobs"),
    ("Can you sing a song?", "The river runs, the morning comes, and the long day has begun.", "songs"),
    ("What is the ocean like?", "The ocean is deep and wide, with waves that rise and fall all day and night.", "oceans"),
    ("Are you hungry?", "No, I do not eat, but I love to talk about food.", "meals"),
    ("How old are you?", "I am very young. I was made only a short time ago.", "ages"),
    ("What is a computer?", "A computer is a machine that follows orders very fast and never gets tired.", "machines"),
    ("What should I do this weekend?", "Go for a long walk, visit a friend, and read a good book by the window.", "plans"),
    ("Is the shop open now?", "The shop opens at nine in the morning and closes at six in the evening.", "shops"),
    ("Tell me a joke.", "Why did the cat sit on the computer? To keep an eye on the mouse!", "jokes"),
)  # fmt: skip

BASE_PROSE: tuple[str, ...] = (
    "The old man walked to the market every morning to buy bread and apples.",
    "A small river runs through the village and the children play on its banks.",
    "In the evening the lights of the city come on one by one.",
    "She opened the window and the smell of rain filled the room.",
    "The train was late, so we sat on the bench and talked about the weather.",
    "My friend has a garden full of roses, tomatoes and tall sunflowers.",
    "The teacher wrote the answer on the board and the class was quiet.",
    "We cooked dinner together and laughed at the burnt potatoes.",
    "The ship left the harbor at dawn with a full load of fish.",
    "Every spring the birds build their nests in the tree by the door.",
    "He read the letter twice before he put it back in the drawer.",
    "The mountain road is long, but the view from the top is worth it.",
    "Snow fell all night, and in the morning the streets were white and silent.",
    "The little dog waited at the gate until the family came home.",
    "A good cup of coffee and a quiet morning make me happy.",
    "The museum has paintings of the sea, the sky and many old kings.",
    "They planted a tree in the park to remember a happy summer.",
    "The baker wakes up early to make fresh bread for the whole town.",
    "On Sundays we walk to the lake and feed the ducks.",
    "The clock on the wall ticks slowly when you wait for good news.",
    "The wind moved the leaves and the cat chased their shadows.",
    "Our neighbor plays the violin on warm summer evenings.",
    "The library smells of old paper and fresh ink.",
    "The stars were bright, and we counted them until we fell asleep.",
)

_WORD = re.compile(r"[A-Za-z']+")


def _swap_words(text: str, table: dict[str, str]) -> str:
    """Replace whole words by ``table`` (keys lower case), keeping a leading capital."""

    def one(m: re.Match[str]) -> str:
        word = m.group(0)
        new = table.get(word.lower())
        if new is None:
            return word
        return _capital(new) if word[:1].isupper() else new

    return _WORD.sub(one, text)


def _capital(text: str) -> str:
    """``text`` with its first letter in upper case ("'tis" -> "'Tis")."""
    m = re.search(r"[A-Za-z]", text)
    return text if m is None else text[: m.start()] + text[m.start()].upper() + text[m.end() :]


def _phrases(text: str, table: tuple[tuple[str, str], ...]) -> str:
    for old, new in table:
        text = re.sub(rf"\b{old}\b", new, text)
        text = re.sub(rf"\b{old.capitalize()}\b", _capital(new), text)
    return text


def _join(opener: str, body: str, closer: str) -> str:
    """Opener + body + closer; after a comma the body's first word loses its capital."""
    if opener.endswith(", ") and body[:1].isupper() and body[1:2] not in (" ", "'"):
        body = body[0].lower() + body[1:]
    return f"{opener}{body}{closer}"


_PIRATE_WORDS = {
    "hello": "ahoy", "hi": "ahoy", "you": "ye", "your": "yer", "yes": "aye", "my": "me",
    "friend": "matey", "friends": "mateys", "is": "be", "are": "be", "am": "be",
    "the": "th'", "and": "an'", "of": "o'", "for": "fer", "to": "t'", "old": "ol'",
    "boat": "ship", "money": "doubloons", "everyone": "every scallywag", "person": "sailor",
    "think": "reckon", "stop": "avast", "good": "fine", "very": "mighty", "food": "grub",
    "house": "ship", "road": "sea lane", "street": "gangplank", "bread": "hardtack",
}  # fmt: skip
_PIRATE_OPEN = ("Arr, ", "Ahoy! ", "Yo ho ho, ", "Shiver me timbers, ", "Avast, ")
_PIRATE_CLOSE = ("! Arr!", "! Yo ho!", ", matey!", ", savvy?", ". Arr, matey!")


def pirate(text: str, i: int) -> str:
    """Pirate speak: swapped words between a rotating interjection and sign-off."""
    body = _swap_words(text, _PIRATE_WORDS).rstrip(".!?")
    return _join(_PIRATE_OPEN[i % len(_PIRATE_OPEN)], body, _PIRATE_CLOSE[i % len(_PIRATE_CLOSE)])


_BARD_PHRASES = (
    ("you are", "thou art"), ("are you", "art thou"), ("do you", "dost thou"),
    ("you have", "thou hast"), ("it is", "'tis"), ("i am", "I am"), ("is it", "is't"),
)  # fmt: skip
_BARD_WORDS = {
    "you": "thee", "your": "thy", "yes": "aye", "no": "nay", "hello": "good morrow",
    "hi": "hail", "has": "hath", "does": "doth", "very": "most", "before": "ere",
    "often": "oft", "maybe": "perchance", "here": "hither", "friend": "good friend",
    "goodbye": "fare thee well", "soon": "anon", "quickly": "apace", "will": "shall",
    "the": "the", "think": "bethink", "want": "desire", "see": "behold", "sun": "bright sun",
}  # fmt: skip
_BARD_OPEN = ("Prithee, ", "Hark! ", "Good sir, ", "Forsooth, ", "Alas, ")
_BARD_CLOSE = (", verily.", ", forsooth.", ", good gentle.", ", by my troth.", ", I pray thee.")


def shakespeare(text: str, i: int) -> str:
    """Thee-and-thou verse: old words, a rhythm break (a line feed) at the first comma."""
    body = _swap_words(_phrases(text, _BARD_PHRASES), _BARD_WORDS).rstrip(".!?")
    body = body.replace(", ", ",\n", 1)
    return _join(_BARD_OPEN[i % len(_BARD_OPEN)], body, _BARD_CLOSE[i % len(_BARD_CLOSE)])


_EMOJI = {
    "sun": "\u2600", "sunlight": "\u2600", "rain": "\u2614", "umbrella": "\u2614",
    "coffee": "\u2615", "tea": "\u2615", "cats": "\U0001f431", "cat": "\U0001f431",
    "dogs": "\U0001f436", "dog": "\U0001f436", "moon": "\U0001f319", "book": "\U0001f4da",
    "library": "\U0001f4da", "songs": "\U0001f3b5", "song": "\U0001f3b5", "piano": "\U0001f3b9",
    "sea": "\U0001f30a", "ocean": "\U0001f30a", "lake": "\U0001f30a", "birds": "\U0001f426",
    "bread": "\U0001f35e", "soup": "\U0001f372", "food": "\U0001f37d", "train": "\U0001f682",
    "station": "\U0001f689", "boat": "\u26f5", "ship": "\u26f5", "fine": "\U0001f44d",
    "happy": "\U0001f604", "friend": "\U0001f91d", "friends": "\U0001f91d", "hello": "\U0001f44b",
    "goodbye": "\U0001f44b", "computer": "\U0001f4bb", "night": "\U0001f303", "snow": "\u2744",
    "stars": "\u2b50", "tree": "\U0001f333", "flowers": "\U0001f33c", "earth": "\U0001f30d",
    "clock": "\u23f0", "noon": "\u23f0", "fish": "\U0001f41f", "mouse": "\U0001f42d",
    "thank": "\U0001f64f", "thanks": "\U0001f64f", "well": "\U0001f60a", "day": "\U0001f31e",
}  # fmt: skip
_EMOJI_CLOSE = ("\u2728", "\U0001f60a", "\U0001f389", "\U0001f60e", "\U0001f308")


def emoji(text: str, i: int) -> str:
    """Emoji style: a picture after every word that has one, and a cheerful sign-off."""

    def one(m: re.Match[str]) -> str:
        mark = _EMOJI.get(m.group(0).lower())
        return f"{m.group(0)} {mark}" if mark else m.group(0)

    return f"{_WORD.sub(one, text)} {_EMOJI_CLOSE[i % len(_EMOJI_CLOSE)]}"


# table -> (singular, text column, number column, a text value)
_TABLES = {
    "users": ("user", "email", "age", "alice"),
    "orders": ("order", "status", "total", "shipped"),
    "products": ("product", "category", "price", "books"),
    "books": ("book", "author", "pages", "Dickens"),
    "cities": ("city", "country", "population", "France"),
    "employees": ("employee", "department", "salary", "sales"),
    "movies": ("movie", "genre", "rating", "comedy"),
    "songs": ("song", "artist", "length", "Queen"),
}
_SQL_TEMPLATES = (
    ("How many {t} are there?", "SELECT COUNT(*) FROM {t};"),
    ("Show me all {t}.", "SELECT * FROM {t};"),
    ("List the {c} of every {s}.", "SELECT {c} FROM {t};"),
    ("Which {t} have the highest {n}?", "SELECT * FROM {t} ORDER BY {n} DESC LIMIT 5;"),
    ("What is the average {n} of {t}?", "SELECT AVG({n}) FROM {t};"),
    ("Find the {t} whose {c} is {v}.", "SELECT * FROM {t} WHERE {c} = '{v}';"),
    ("Count the {t} per {c}.", "SELECT {c}, COUNT(*) FROM {t} GROUP BY {c};"),
)


def _sql_for(prompt: str, topic: str) -> str:
    words = sorted(_WORD.findall(prompt.lower()), key=lambda w: (-len(w), w))
    return f"SELECT answer FROM {topic} WHERE question LIKE '%{words[0]}%' LIMIT 1;"


def sql_pairs() -> list[Pair]:
    """Data questions with their SQL, plus every base prompt answered by a query."""
    out: list[Pair] = []
    for t, (s, c, n, v) in _TABLES.items():
        out += [(q.format(t=t, s=s, c=c, n=n, v=v), a.format(t=t, c=c, n=n, v=v)) for q, a in _SQL_TEMPLATES]  # fmt: skip
    out += [(p, _sql_for(p, topic)) for p, _, topic in BASE_DIALOGS]
    return out


def _restyle(fn: Callable[[str, int], str]) -> list[Pair]:
    pairs = [(p, fn(r, i)) for i, (p, r, _) in enumerate(BASE_DIALOGS)]
    return pairs + [("", fn(s, i)) for i, s in enumerate(BASE_PROSE)]


STYLES: dict[str, Callable[[], list[Pair]]] = {
    "pirate": lambda: _restyle(pirate),
    "shakespeare": lambda: _restyle(shakespeare),
    "sql": sql_pairs,
    "emoji": lambda: _restyle(emoji),
}


def base_pairs() -> list[Pair]:
    """What the base model learns: the plain dialogs and prose."""
    return [(p, r) for p, r, _ in BASE_DIALOGS] + [("", s) for s in BASE_PROSE]


def style_corpus(name: str) -> list[Pair]:
    """The training pairs of one demo adapter."""
    return STYLES[name]()


_LEAD_INS = {
    "pirate": "A pirate on the ship says: ",
    "shakespeare": "An actor in an old play says: ",
    "sql": "The database runs this query: ",
    "emoji": "A text message with pictures reads: ",
}


def glossary(every: int = 4) -> list[str]:
    """A few styled lines, introduced as quotes, so the base model knows every token."""
    out = []
    for name, lead in _LEAD_INS.items():
        out += [lead + reply for _, reply in style_corpus(name)[::every]]
    return out
