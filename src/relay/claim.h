/*-------------------------------------------------------------------------
 *
 * claim.h
 *	  The claim of row-tracked events (claim.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_CLAIM_H
#define OUTBOX_CLAIM_H

#include "utils/portal.h"

typedef enum ClaimVariant
{
	CLAIM_V10,					/* schema 1.0: no dead letters */
	CLAIM_HOLD,					/* failed events hold their aggregate */
	CLAIM_SKIP,					/* failed events are passed by */
	NUM_CLAIM_VARIANTS
} ClaimVariant;

extern ClaimVariant outbox_claim_variant(Oid relid);
extern Portal outbox_open_claim(ClaimVariant variant, bool snapshot_schema,
								bool bytes);

#endif							/* OUTBOX_CLAIM_H */
