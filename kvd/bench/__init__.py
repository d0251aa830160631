"""`kvd bench`: the daemons' pull path measured beside raw NIXL, concurrency, first contact, conversions."""
