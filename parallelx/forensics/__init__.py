"""When ranks part ways: which rank, which call, which line.

:mod:`~parallelx.forensics.record` keeps each rank's collectives (a bounded ring of
sequence-numbered calls with the user's line that led to each);
:mod:`~parallelx.forensics.verdict` reads every rank's record into one sentence;
:mod:`~parallelx.forensics.exchange` swaps the records over a store that does not
depend on the stuck group when a call outlasts its time or a rank raises, and
prints that sentence on every rank (``docs/hangs.md``)."""
