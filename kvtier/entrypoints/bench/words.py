"""The fixed vocabulary the multi-turn workload writes its text from.

Every word, with a leading space, is a single token for the SmolLM2 tokenizer (checked by
tests/entrypoints/bench/test_words.py), so `n` words joined by spaces are `n` tokens of the
default model.
That is what lets the workload ask for "a 1,000-token context" without loading the server's
tokenizer; for other models the lengths are approximate, and the report counts the tokens the
server itself says it processed.
The list never changes order: the workload indexes it with a seeded RNG, so editing it changes
every benchmark's prompts.
"""

WORDS: tuple[str, ...] = (
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world",
    "school", "state", "family", "student", "group", "country", "problem", "hand", "part",
    "place", "case", "week", "company", "system", "program", "question", "work", "government",
    "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story",
    "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue",
    "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game",
    "line", "end", "member", "law", "car", "city", "community", "name", "president", "team",
    "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others", "level",
    "office", "door", "health", "person", "art", "war", "history", "party", "result", "change",
    "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force",
    "education", "river", "garden", "window", "table", "bread", "apple", "stone", "cloud",
    "light", "music", "paper", "letter", "street", "market", "summer", "winter", "forest",
    "ocean", "mountain", "island", "bridge", "road", "train", "plane", "ship", "horse", "bird",
    "fish", "tree", "flower", "grass", "field", "farm", "village", "castle", "tower", "wall",
    "floor", "chair", "bed", "kitchen", "glass", "plate", "cup", "knife", "spoon", "coffee",
    "tea", "milk", "sugar", "salt", "rice", "egg", "cheese", "butter", "fruit", "orange", "lemon",
    "green", "blue", "red", "yellow", "black", "white", "brown", "small", "large", "quick",
    "slow", "bright", "dark", "warm", "cold", "soft", "hard", "early", "late", "happy", "quiet",
    "simple", "strong", "young", "old", "new", "good", "great", "little", "long", "high",
    "different", "important", "public", "able",
)
