"""Plain English prose that synthetic prompts are cut from, so the model reads real text rather than random ids."""

CORPUS = """\
The river town woke slowly on market days. Before the sun cleared the hills, carts rolled over the old stone bridge,
loaded with cabbages, apples, wheels of cheese and baskets of brown eggs. The baker had been awake since three, and the
smell of his bread drifted down the lanes to the water, where the ferryman sat smoking his pipe and waiting for the
first passengers of the day. Children ran between the stalls, and the dogs followed them, hoping for crumbs.

A library is a quiet machine for moving ideas through time. Someone writes a book, someone else shelves it, and years
later a stranger takes it down, opens it at a random page and finds exactly the sentence she needed. Librarians know
that the catalogue is only half of the work; the other half is helping people ask the question they really mean, which
is rarely the question they first put into words.

Photosynthesis turns light into chemistry. In the leaves of a plant, chlorophyll absorbs red and blue light and uses its
energy to split water, releasing oxygen and storing the captured energy in small carrier molecules. A second set of
reactions then uses those carriers to fix carbon dioxide from the air into sugars. Nearly every calorie eaten on Earth
began as sunlight caught this way, and the oxygen we breathe is the by-product.

The committee met on Tuesday to review the budget for the coming year. Revenue from ticket sales had risen by eleven
percent, but maintenance costs for the concert hall had grown even faster, largely because the heating system was
older than anyone on the committee. After a long discussion, the members agreed to delay the new lighting rig, repair
the boiler first, and ask the city council for a small grant to cover the remaining gap.

Learning to cook is mostly learning to pay attention. A recipe tells you to brown the onions for ten minutes, but your
stove, your pan and your onions are not the ones the author used, so the real instruction is to watch the colour, listen
to the sizzle and smell the moment sweetness replaces sharpness. Good cooks taste constantly, adjust the salt, and are
not afraid to throw away a sauce that went wrong and start again.

When the storm arrived, it came from the west in a single dark wall. The fishing boats had already returned to the
harbour, their crews warned by the falling barometer and the strange green colour of the sky. For six hours the wind
pulled at roofs and shutters, the rain ran sideways through the streets, and the lighthouse beam swept through the spray.
By morning the sea was calm again, and the beach was covered with driftwood, seaweed and a single lost rowing boat.

Computers store numbers in binary because a switch that is either on or off is easy to build and hard to misread. Eight
such switches make a byte, enough to count from zero to two hundred and fifty-five. Text, images and sound are all
encoded as long sequences of these numbers, and programs are themselves numbers that tell the processor which small
operation to perform next: add these two values, compare them, jump to another instruction, or write a result to memory.

The old woman kept bees at the end of her garden, in five white hives beneath the plum trees. She said the bees knew
when someone in the house was sad, and that you had to tell them the news, good or bad, or they would leave. Every
summer she took the honey in late July, leaving enough for the winter, and gave jars of it to the neighbours, the
postman and anyone who stopped at her gate to admire the roses.

Mountains are built slowly and worn down slowly. When two plates of the crust push against each other, the rock buckles
and rises over millions of years, and at the same time rain, ice and wind begin to carry it away, grain by grain, into
the rivers and finally the sea. The sharp peaks of young ranges and the rounded hills of old ones are two moments in the
same long story, told at a speed no human can watch.

A good meeting has a purpose, a short list of decisions to make, and someone willing to end it when those decisions are
made. Most bad meetings lack at least one of the three. People arrive without knowing why they were invited, the
discussion wanders, and an hour later everyone leaves with a vague feeling that something was agreed, though no two of
them would describe it the same way.

The train left the city just after dusk and ran north through the night. In the dining car, a waiter in a white jacket
served soup that slid gently from side to side in the bowls, while outside the windows the lights of small stations
flashed past and vanished. Some passengers talked quietly, some read, and a young man in the corner wrote a long letter
that he would never send, folding it carefully into his coat pocket when the lights dimmed.

Vaccines teach the immune system to recognise a threat before it meets the real thing. They present a harmless piece or
copy of a pathogen, and the body responds by producing antibodies and memory cells. If the real infection arrives
later, those memory cells react within days instead of weeks, often stopping the illness before it becomes serious.
Because protection spreads through a community, vaccinating many people also shields those who cannot be vaccinated.
"""
