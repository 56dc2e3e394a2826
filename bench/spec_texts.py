"""Texts for bench/spec_workloads.py, written for this benchmark: the sentences of a made-up town's
history (each with a keyword no other sentence contains, so "the sentence that mentions X" has one
answer) and small Python functions whose main variable is the placeholder VAR."""

from __future__ import annotations

SENTENCES: tuple[tuple[str, str], ...] = (
    ("lighthouse", "The old lighthouse at the mouth of the river was built in 1842 by a merchant who had lost two ships to the fog in a single winter."),
    ("ferry", "Every morning before dawn the ferry carried milk, eggs and newspapers across the water to the farms on the eastern bank."),
    ("bakery", "The bakery on Mill Street kept its ovens burning through the night, and the smell of rye loaves reached the harbour by five o'clock."),
    ("schoolhouse", "In 1871 the town opened a schoolhouse with two rooms, one for children under ten and one for the older pupils who could already read."),
    ("flood", "The great flood of 1903 rose eleven feet in two days and left a brown line on the church wall that can still be seen today."),
    ("orchard", "South of the goods yard the apple orchard stretched for almost a mile, and in October the whole valley smelled of cider."),
    ("clocktower", "The clocktower in the market square has run three minutes slow for as long as anyone can remember, and nobody has ever tried to fix it."),
    ("librarian", "The first librarian, Agnes Porter, catalogued every book by hand and refused to lend novels to anyone who returned them late."),
    ("seven arches", "A stone bridge with seven arches replaced the wooden crossing in 1888, after a cart loaded with timber broke through the old planks."),
    ("telegraph", "When the telegraph line arrived in 1859, the postmaster learned to read the clicking signals by ear and would translate them for a penny."),
    ("quarry", "Most of the grey stone in the older houses came from the quarry on Heron Hill, which closed after a rockfall in the spring of 1912."),
    ("lantern", "Each summer the lantern festival fills the river with hundreds of small paper boats, each carrying a candle and a written wish."),
    ("water mill", "The water mill ground flour for six villages until the river changed its course and left the wheel standing in a dry channel."),
    ("inns", "The railway reached the town in 1865, and within ten years the number of inns near the station had grown from one to nine."),
    ("ledger", "The harbour master kept a ledger of every vessel that entered the port, noting its cargo, its captain and the weather on the day it arrived."),
    ("fishmongers", "On Saturdays the market ran from the church steps to the fountain, with fishmongers on one side and cloth sellers on the other."),
    ("tannery", "A fire in the tannery in 1897 spread to four neighbouring houses before the volunteers could form a line of buckets from the river."),
    ("observatory", "A retired sea captain built a small observatory on the roof of his house and invited the schoolchildren to look at the moon on clear nights."),
    ("Christmas Eve", "The church choir has sung the same carol at midnight on Christmas Eve every year since 1790, except for one winter when the roof collapsed."),
    ("brewery", "The brewery by the north gate used water from a spring that local people believed could cure a fever if drunk before breakfast."),
    ("shipyard", "At its busiest the shipyard employed three hundred men and launched a new fishing boat almost every month."),
    ("museum", "The town museum occupies the former customs house and displays a collection of maps, compasses and letters written by sailors to their families."),
    ("skis", "In the winter of 1947 the snow lay so deep that the baker delivered bread on skis and the school stayed closed for three weeks."),
    ("Caroline", "The cemetery on the hill holds the graves of forty sailors who drowned when the steamer Caroline sank within sight of the harbour."),
    ("windmill", "A windmill once stood on the western ridge, but a storm tore off its sails in 1930 and only the round brick tower remains."),
    ("dentist", "The cottage hospital opened with eight beds and a single doctor, who also served as the town's dentist on Thursday afternoons."),
    ("gossip", "The weekly newspaper printed shipping news on the front page and gossip on the back, and most readers turned to the back first."),
    ("coal fields", "Plans for a canal to the coal fields were drawn up twice, in 1820 and in 1851, but the money ran out both times before digging began."),
    ("bronze", "The bronze fountain in the square was a gift from a cousin of the mayor who had made a fortune selling tea in distant ports."),
    ("Clay Lane", "The pottery on Clay Lane made blue and white plates that were sold as far away as the capital, where they were thought to be foreign."),
    ("regatta", "The rowing regatta in August draws crews from every town along the coast, and the winners are given a silver cup and a barrel of ale."),
    ("tram", "For twenty years a horse-drawn tram ran from the station to the harbour, until the horses were sold and the rails were pulled up for scrap."),
    ("Anchor", "The Anchor Inn claims to be the oldest building in the town, although its oak beams were taken from a ship that was wrecked in 1760."),
    ("herbs", "Behind the town hall lies a walled garden where the council once grew medicinal herbs for the poor and where roses now grow instead."),
    ("strike", "In 1926 the dock workers went on strike for nine days, and the fishermen's wives cooked soup for their families in the church hall."),
    ("cinema", "The cinema opened in 1921 with a piano player for the silent films and closed in 1968 when most families had bought a television."),
    ("lifeboat", "The lifeboat crew has rescued more than six hundred people since 1861, and their names are painted on boards inside the boathouse."),
    ("Salt Way", "Before the trains came, salt was the town's most valuable trade, and carts carried it inland along a road still called the Salt Way."),
    ("wool", "Wool from the hill farms was washed in the river, spun in the cottages and sold each spring to merchants who came by boat from the south."),
    ("bathing hut", "A bathing hut was built on the beach in 1899 so that visitors from the city could change without being seen from the promenade."),
    ("bell ringers", "The eight church bells were recast in 1950, and the bell ringers practised every Tuesday evening whether or not there was a wedding that week."),
    ("skating", "During the coldest winters the river froze at the bend, and the whole town went skating on the ice by the light of burning torches."),
    ("lamplighter", "Gas lamps were installed along the promenade in 1868, and a lamplighter walked the length of it every evening at sunset."),
    ("pier", "The pier was lengthened twice so that larger steamers could dock at low tide, and it now reaches almost a quarter of a mile into the bay."),
)

RENAMES: tuple[tuple[str, str], ...] = (
    ("records", "rows"), ("items", "entries"), ("values", "samples"), ("orders", "purchases"),
    ("events", "messages"), ("scores", "points"), ("readings", "measurements"), ("users", "members"),
)

CODE_HEADER = '''"""Small helpers for a nightly report job."""

import csv
import json
import statistics
from collections import defaultdict'''

CODE_BLOCKS: tuple[str, ...] = (
    '''def load_VAR(path):
    """Read one record per line from a CSV file, skipping comments."""
    VAR = []
    with open(path, newline="") as handle:
        for row in csv.reader(handle):
            if not row or row[0].startswith("#"):
                continue
            VAR.append([field.strip() for field in row])
    return VAR''',
    '''def filter_VAR(VAR, minimum):
    """Keep the records whose amount is at least minimum."""
    kept = []
    for record in VAR:
        if float(record[2]) >= minimum:
            kept.append(record)
    return kept''',
    '''def count_VAR(VAR):
    """How many records each key has."""
    counts = defaultdict(int)
    for record in VAR:
        counts[record[0]] += 1
    return dict(counts)''',
    '''def moving_average(VAR, window):
    """The mean of each run of `window` consecutive amounts."""
    if window <= 0:
        raise ValueError("window must be positive")
    amounts = [float(record[2]) for record in VAR]
    return [sum(amounts[i : i + window]) / window for i in range(len(amounts) - window + 1)]''',
    '''def group_VAR(VAR):
    """Records grouped by their first field, in order of first appearance."""
    groups = {}
    for record in VAR:
        groups.setdefault(record[0], []).append(record)
    return groups''',
    '''def top_VAR(VAR, n=5):
    """The n records with the largest amounts, largest first."""
    ranked = sorted(VAR, key=lambda record: float(record[2]), reverse=True)
    return ranked[:n]''',
    '''def summarize_VAR(VAR):
    """Count, mean and median of the amounts (zeros when there are none)."""
    amounts = [float(record[2]) for record in VAR]
    if not amounts:
        return {"count": 0, "mean": 0.0, "median": 0.0}
    return {
        "count": len(amounts),
        "mean": statistics.mean(amounts),
        "median": statistics.median(amounts),
    }''',
    '''def write_VAR(VAR, path):
    """Write the records as JSON lines."""
    with open(path, "w") as handle:
        for record in VAR:
            handle.write(json.dumps(record) + "\\n")
    return len(VAR)''',
    '''def validate_VAR(VAR):
    """The line numbers of records with a missing key or a bad amount."""
    bad = []
    for number, record in enumerate(VAR, start=1):
        if len(record) < 3 or not record[0]:
            bad.append(number)
            continue
        try:
            float(record[2])
        except ValueError:
            bad.append(number)
    return bad''',
    '''def merge_VAR(VAR, others):
    """Both lists of records, without duplicates, in their original order."""
    seen = set()
    merged = []
    for record in list(VAR) + list(others):
        key = tuple(record)
        if key not in seen:
            seen.add(key)
            merged.append(record)
    return merged''',
    '''def paginate_VAR(VAR, page_size):
    """The records split into pages of page_size (the last may be shorter)."""
    pages = []
    for start in range(0, len(VAR), page_size):
        pages.append(VAR[start : start + page_size])
    return pages''',
)
