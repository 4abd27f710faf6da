/*-------------------------------------------------------------------------
 *
 * fault_point.h
 *	  A test hook at the named steps of a relay batch (fault_point.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef OUTBOX_FAULT_POINT_H
#define OUTBOX_FAULT_POINT_H

extern void outbox_fault_point(const char *moment);

#endif							/* OUTBOX_FAULT_POINT_H */
