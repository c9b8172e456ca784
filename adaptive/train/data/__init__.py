"""Training data: where text comes from (sources, with local JSON rows checked first in rows), the
tokenizer (tokenizer), blocks packed and sharded per rank (packing), instruction rows rendered with a loss
mask (instructions) and cut, padded or packed into blocks (instruction_blocks), the streaming path's worker
loader (loader), and micro-batches with a resumable position (batches). It imports no other part of
`adaptive.train`."""
