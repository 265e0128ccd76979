/* AMX tiles as the product kernels use them (q4_gemv.c: int8, packed_gemv.c: bfloat16): the
 * permission Linux asks for, and one tile layout for both. */
#ifndef SLUICE_AMX_H
#define SLUICE_AMX_H

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* the kernel grants AMX's register state to a process that asks (Linux 5.16+); asked once per
 * kernel file */
static inline int amx_usable(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return state;
}

/* palette 1 on the calling thread: tiles 0-3 a product's sums (rows x 16 32-bit lanes), tile 4 the
 * rows' inputs (rows x a_bytes), tiles 5-7 the weight (b_rows x 64 bytes) */
static inline void amx_configure(int rows, int a_bytes, int b_rows) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = 64;
    cfg.rows[4] = (uint8_t)rows, cfg.colsb[4] = (uint16_t)a_bytes;
    for (int t = 5; t < 8; t++) cfg.rows[t] = (uint8_t)b_rows, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}
#endif

#endif
