"""Small fixed word lists the task families draw keys, names and answers from.

Every answer word is a single word (normalizes to one item, see scoring.py). The lists are
ours and fixed: changing them changes every generated task.
"""

ADJECTIVES = """
amber ancient bitter brave bright calm clever cold crimson curious dark eager early fancy
fierce gentle golden green hidden hollow humble icy jolly lively lonely lucky misty narrow
noble odd pale proud quiet rapid rough royal rusty silent silver sleepy smooth solid steady
sudden swift tall tender tiny violet warm wild wise young
""".split()

NOUNS = """
anchor apple arrow badger banner basket beacon bell bridge candle canyon castle cedar cliff
comet compass crane crystal desert dragon eagle ember falcon feather forest fountain garden
glacier harbor hawk island jungle kettle lantern lemon meadow mirror monkey mountain needle
ocean orchard otter panther pebble pepper piano pillar planet pond rabbit raven river rocket
saddle shadow shell spider spoon storm sunset temple thunder tiger tower valley violin wagon
whale willow window wolf
""".split()

FIRST_NAMES = """
Alice Bruno Clara Daniel Elena Felix Greta Hugo Irene Jonas Karin Leo Maria Nora Oscar Paula
Quentin Rosa Simon Tara Victor Wanda Xavier Yara Zoe Anton Bianca Carlos Dora Emil
""".split()

LAST_NAMES = """
Adler Becker Castro Dalton Ellis Fischer Garcia Hansen Ibsen Jensen Keller Lambert Moreau
Novak Olsen Perez Quinn Romero Schulz Torres Ulrich Vargas Walsh Young Ziegler Brandt Costa
Dumont Egger Frost
""".split()

CITIES = """
Paris Tokyo Cairo Lima Oslo Madrid Berlin Dublin Vienna Prague Warsaw Lisbon Athens Rome
Moscow Delhi Mumbai Beijing Seoul Bangkok Jakarta Manila Sydney Toronto Chicago Boston Denver
Seattle Houston Miami Nairobi Lagos Havana Santiago Bogota Helsinki Stockholm Budapest
Brussels Amsterdam Zurich Geneva Munich Hamburg Barcelona
""".split()

JOBS = """
baker carpenter dentist doctor farmer firefighter gardener journalist lawyer librarian
mechanic musician nurse painter pilot plumber poet sailor scientist singer soldier tailor
teacher translator veterinarian waiter architect butcher chemist engineer
""".split()

COLORS = """
red blue green yellow orange purple pink brown black white gray violet turquoise beige maroon
crimson indigo lavender olive teal
""".split()

ANIMALS = """
cat dog horse rabbit parrot hamster turtle goldfish snake lizard ferret pony goat sheep duck
chicken canary tortoise donkey llama
""".split()
