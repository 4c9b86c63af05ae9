"""SSD (speculative speculative decoding, Saguaro): the host loop, its device programs, the
placement of the two models on their device groups, and its own draft_len="auto"."""
