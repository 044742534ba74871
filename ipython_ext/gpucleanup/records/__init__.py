"""The cells' records and what is told from them: the line, %gpumem's report, history, totals, timeline, plot."""
