"""A small original English text used to train the tokenizers of random test checkpoints."""

SAMPLE_TEXT = """\
The morning train left the station a little after six, and the town was still quiet.
A baker carried trays of warm bread across the square while two dogs watched him hopefully.
Nobody in the house had expected the letter, yet everyone behaved as if they had known for weeks.
She read it twice, folded it carefully, and put it in the drawer with the older letters.
The river had risen during the night; by noon the lower fields were covered with bright water.
Children ran along the bank throwing sticks, and the ducks floated past in a patient line.
It is a truth that small towns remember everything and forgive most of it in time.
He said that the meeting would begin at ten o'clock, but the chairman arrived at half past.
The committee discussed the budget, the new bridge, the school roof and the price of coal.
When the rain stopped, the sky turned a clean pale blue and the streets shone like glass.
Numbers such as 1, 2, 3, 10, 42, 100 and 2026 appear in reports, tables and old receipts.
Questions are welcome: what time is it? where are we going? why is the kettle singing?
The garden behind the library grows roses, beans, tall sunflowers and a stubborn apple tree.
Every evening the lamps were lit one by one, and the windows glowed yellow along the hill.
They walked home slowly, talking about the weather, the harvest and the strange letter.
"""
