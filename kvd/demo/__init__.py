"""What ``kvd demo`` and the end-to-end tests drive: a reference engine and a two-turn conversation.

* :mod:`kvd.demo.reference_engine`: a small paged-attention engine with kvd's connector
  (:mod:`kvd_engine`) plugged in, whose KV values are a function of (token, position), so that
  every byte an engine reads can be checked;
* :mod:`kvd.demo.conversation`: prefill -> decode (speculative) -> next turn between two of them.

Kept out of the shipped connector package: an engine that loads ``kvd_engine`` loads none of this.
"""
