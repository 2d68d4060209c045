// The copy geometry of one row of HS_VEC 16-byte vectors, shared by copy.cu and vllm_ops.cu (their
// builds define HS_VEC; HS_GNT threads a block and HS_UNROLL slots in flight a thread default here).
#pragma once

#ifndef HS_VEC
#error "HS_VEC (16-byte vectors per row) must be defined"
#endif
#ifndef HS_GNT
#define HS_GNT 256
#endif
#ifndef HS_UNROLL
#define HS_UNROLL 4
#endif
#define HS_ROW_BYTES (HS_VEC * 16)
// Lines of 128 bytes a row starting at a 16-byte aligned address can touch, and its slots.
#define HS_ROW_LINES ((HS_ROW_BYTES + 111) / 128 + 1)
#define HS_SLOTS (HS_ROW_LINES * 8)
