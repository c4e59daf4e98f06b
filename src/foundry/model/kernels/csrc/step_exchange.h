/* A rank's gates as the one-token step (step.c) calls them: the interface a transport fills in
 * (a Python hook in py_step.c; a world's TCP mesh in transport/gates/_gates.c, which includes
 * this header and hands the step a filled struct in a capsule named STEP_EXCHANGE_CAPSULE).
 *
 * At each gate of layer `layer`, the step calls fn with the rank's partial (d floats): fn
 * replaces it in place with the world's total, 0, or -1 when the exchange failed (step_whole
 * then returns STEP_EXCHANGE). A transport that can send before the whole partial is known
 * also fills begin and post: begin(ctx, layer, gate, partial) as the gate's product starts
 * writing `partial`, then post(ctx, chunk) as each chunk c of it, the columns
 * [c d / world, (c + 1) d / world), is final (never this rank's own chunk), then fn. A gate
 * may go to fn without begin (a product the step does not cut). */

#ifndef FOUNDRY_STEP_EXCHANGE_H
#define FOUNDRY_STEP_EXCHANGE_H

#define STEP_EXCHANGE_CAPSULE "foundry.step_exchange"

typedef struct {
    int (*fn)(void *ctx, int layer, int gate, float *sum);
    void (*begin)(void *ctx, int layer, int gate, const float *partial); /* NULL: no posts */
    void (*post)(void *ctx, int chunk);
    void *ctx;
    int layer;       /* the caller sets it before each layer */
    int world, rank; /* the chunks post numbers */
    int d;           /* the partial's floats (0: whatever the plan's is) */
} step_exchange;

enum { STEP_EXCHANGE = -2 };

#endif
